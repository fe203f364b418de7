"""The job store: one SQLite file beside the videos (`<output>/jobs.sqlite3`), the only place status is read from.

The HTTP handlers read it and insert into it; the engine loop writes status, progress and results. Rows hold plain
values and JSON text, never pickles. A restarted server lists the finished jobs and serves their files; jobs that
were queued or running when it stopped are marked failed with the reason (`recover`), since the engine that held
them is gone and re-running them would not be the run the client saw start.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STORE_NAME = "jobs.sqlite3"
QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
STATUSES = (QUEUED, IN_PROGRESS, COMPLETED, FAILED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS videos (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    model TEXT NOT NULL,
    params TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    started_at REAL,
    completed_at INTEGER,
    file TEXT,
    error_code TEXT,
    error_message TEXT,
    timings TEXT
)
"""


@dataclass
class JobRecord:
    """One row: `params` are the job's resolved request fields as the API shows them (JSON-safe values)."""

    id: str
    status: str
    model: str
    params: dict[str, Any]
    created_at: int
    progress: int = 0
    started_at: float | None = None
    completed_at: int | None = None
    file: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    seq: int = 0


class JobStore:
    """Thread-safe access to the store. Writes go through one connection under one lock, each one short transaction;
    reads use a connection of the reading thread's own and take no lock: in SQLite's WAL mode a reader sees the last
    committed state without waiting for a writer, so a status read on the HTTP event loop never waits for a progress
    write of another thread (one that is slow, or whose thread the OS has put aside while it held the lock)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = self._connect()
        self._watchers: list[Callable[..., None]] = []
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        db.row_factory = sqlite3.Row
        return db

    def _reader(self) -> sqlite3.Connection:
        """This thread's read connection (opened on its first read)."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
            db.execute("PRAGMA query_only=ON")
            with self._readers_lock:
                self._readers.append(db)
        return db

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def watch(self, on_write: Callable[..., None]) -> None:
        """Call `on_write(record, step=..., steps=...)` with a job's row after each write to it (events.py); a
        progress write also passes the denoising step it stands for."""
        self._watchers.append(on_write)

    def _wrote(self, job_id: str, **extra: int) -> None:
        if not self._watchers:
            return
        record = self.get(job_id)
        if record is not None:
            for on_write in self._watchers:
                on_write(record, **extra)

    # -- writes ----------------------------------------------------------------------------------
    def recover(self, reason: str) -> int:
        """Mark the jobs a previous server left queued or running as failed; returns how many."""
        with self._tx() as db:
            cursor = db.execute(
                "UPDATE videos SET status=?, error_code=?, error_message=?, completed_at=? WHERE status IN (?, ?)",
                (FAILED, "server_restarted", reason, int(time.time()), QUEUED, IN_PROGRESS),
            )
            return cursor.rowcount

    def insert(self, record: JobRecord) -> JobRecord:
        with self._tx() as db:
            cursor = db.execute(
                "INSERT INTO videos (id, status, progress, model, params, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (record.id, record.status, record.progress, record.model, json.dumps(record.params), record.created_at),
            )
            record.seq = int(cursor.lastrowid or 0)
        self._wrote(record.id)
        return record

    def mark_running(self, job_id: str, *, replica: int = 0) -> None:
        """The job started on data-parallel replica `replica` (the `started` event says which)."""
        with self._tx() as db:
            db.execute(
                "UPDATE videos SET status=?, started_at=?, progress=0 WHERE id=?", (IN_PROGRESS, time.time(), job_id)
            )
        self._wrote(job_id, replica=replica)

    def set_progress(self, job_id: str, progress: int, *, step: int = 0, steps: int = 0) -> None:
        """`progress` percent, after denoising step `step` of `steps`."""
        with self._tx() as db:
            db.execute("UPDATE videos SET progress=? WHERE id=? AND status=?", (progress, job_id, IN_PROGRESS))
        self._wrote(job_id, step=step, steps=steps)

    def mark_completed(self, job_id: str, file: str, timings: dict[str, float]) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE videos SET status=?, progress=100, file=?, timings=?, completed_at=? WHERE id=?",
                (COMPLETED, file, json.dumps(timings), int(time.time()), job_id),
            )
        self._wrote(job_id)

    def mark_failed(self, job_id: str, code: str, message: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE videos SET status=?, error_code=?, error_message=?, completed_at=? WHERE id=?",
                (FAILED, code, message, int(time.time()), job_id),
            )
        self._wrote(job_id)

    def delete(self, job_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM videos WHERE id=?", (job_id,)).rowcount > 0

    # -- reads -----------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobRecord | None:
        # fetchall: the statement is done when this returns, so no read stays open to hold back a WAL checkpoint
        rows = self._reader().execute("SELECT * FROM videos WHERE id=?", (job_id,)).fetchall()
        return _record(rows[0]) if rows else None

    def page(self, *, limit: int, after: str | None = None, newest_first: bool = True) -> tuple[list[JobRecord], bool]:
        """Up to `limit` jobs after the job `after` (exclusive) in the chosen order, and whether more follow.
        KeyError if `after` is not a job."""
        db = self._reader()
        db.execute("BEGIN")  # one snapshot for both queries
        try:
            where, args = "", []
            if after is not None:
                row = db.execute("SELECT seq FROM videos WHERE id=?", (after,)).fetchone()
                if row is None:
                    raise KeyError(after)
                where, args = ("WHERE seq < ?" if newest_first else "WHERE seq > ?"), [row["seq"]]
            order = "DESC" if newest_first else "ASC"
            rows = db.execute(
                f"SELECT * FROM videos {where} ORDER BY seq {order} LIMIT ?", (*args, limit + 1)
            ).fetchall()
        finally:
            db.execute("COMMIT")
        return [_record(r) for r in rows[:limit]], len(rows) > limit

    def counts(self) -> dict[str, int]:
        rows = self._reader().execute("SELECT status, COUNT(*) AS n FROM videos GROUP BY status").fetchall()
        found = {row["status"]: int(row["n"]) for row in rows}
        return {status: found.get(status, 0) for status in STATUSES}

    def close(self) -> None:
        with self._readers_lock:
            for db in self._readers:
                db.close()
            self._readers.clear()
        with self._lock:
            self._db.close()


def _record(row: sqlite3.Row) -> JobRecord:
    return JobRecord(
        id=row["id"],
        status=row["status"],
        model=row["model"],
        params=json.loads(row["params"]),
        created_at=int(row["created_at"]),
        progress=int(row["progress"]),
        started_at=row["started_at"],
        completed_at=row["completed_at"],
        file=row["file"],
        error_code=row["error_code"],
        error_message=row["error_message"],
        timings=json.loads(row["timings"]) if row["timings"] else {},
        seq=int(row["seq"]),
    )
