"""A Hugging Face hub cache laid out as ``huggingface_hub`` lays it out, filled from a local checkpoint folder: for
testing repo ids as `--model` offline.

    write_hub_cache(checkpoint, cache_dir, "Wan-AI/Wan2.2-TI2V-5B-Diffusers")

writes ``cache_dir/models--Wan-AI--Wan2.2-TI2V-5B-Diffusers/`` with ``blobs/<sha256>`` (each file's bytes once),
``snapshots/<commit>/<path>`` (relative symlinks into ``blobs``) and ``refs/main`` (the commit), which
``snapshot_download(repo_id, local_files_only=True)`` resolves with ``HF_HUB_CACHE=cache_dir``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["repo_folder_name", "write_hub_cache"]


def repo_folder_name(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def write_hub_cache(checkpoint: str | Path, cache_dir: str | Path, repo_id: str, commit: str = "1" * 40) -> Path:
    """Add `checkpoint`'s files to the hub cache at `cache_dir` as the snapshot `commit` of `repo_id` (its main
    branch); returns the snapshot folder."""
    src = Path(checkpoint).resolve()
    repo = Path(cache_dir) / repo_folder_name(repo_id)
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in src.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / file.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
