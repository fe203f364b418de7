"""The job manifest, `manifest.jsonl` in the output folder: one JSON line per finished item (done or failed), appended
atomically, read back to resume: an item whose last line is `done` with the same fingerprint and whose video is
still there, whole (its size and sha256 as recorded), is not redone."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.jsonl"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Manifest:
    def __init__(self, folder: Path):
        self.folder = folder
        self.path = folder / MANIFEST

    def read(self) -> dict[int, dict[str, Any]]:
        """The last record of every index; lines that do not parse (a write cut by a crash) are skipped."""
        records: dict[int, dict[str, Any]] = {}
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return records
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("index"), int):
                records[record["index"]] = record
        return records

    def append(self, record: dict[str, Any]) -> None:
        """One line, one write, O_APPEND, then fsync: a reader sees the whole line or nothing of it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def finished(self, fingerprints: Iterable[tuple[int, str]]) -> dict[int, dict[str, Any]]:
        """The records of the (index, fingerprint) pairs that need no new run."""
        records = self.read()
        done = {}
        for index, fingerprint in fingerprints:
            record = records.get(index)
            if record is None or record.get("status") != "done" or record.get("fingerprint") != fingerprint:
                continue
            video = self.folder / str(record.get("video", ""))
            try:
                whole = video.is_file() and video.stat().st_size == record.get("bytes")
                if whole and file_sha256(video) == record.get("sha256"):
                    done[index] = record
            except OSError:
                continue
        return done
