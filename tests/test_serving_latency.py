"""What keeps the service answering quickly while its replicas are busy (issue 29's latency targets; the figures are
`benchmarks/serve_load.py --compare-replicas`'s, in docs/BENCHMARKS.md, never asserted here):

- a status read never waits for a store write: a write that waits for the database (another process holds its lock,
  as a slow disk or a writer put aside by the OS would make it wait) must not hold a read, here or on the event loop;
- the first request of each kind imports nothing: a module imported on the event loop holds every other request
  meanwhile (the first event stream imported anyio's asyncio backend there, in the burst of the first submissions).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distvideo.serving.store import QUEUED, JobRecord, JobStore


def _hold_write_lock(path: Path) -> sqlite3.Connection:
    """Another connection that holds the database's write lock until it is closed."""
    other = sqlite3.connect(str(path), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    return other


def _wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g} s: {what}")
        time.sleep(0.01)


def test_a_status_read_does_not_wait_for_a_write_that_waits_for_the_database(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.insert(JobRecord(id="video_a", status=QUEUED, model="m", params={}, created_at=0))
    other = _hold_write_lock(store.path)
    writer = threading.Thread(target=store.mark_running, args=("video_a",))
    try:
        writer.start()
        # the write is under way: it holds the store's own write lock while SQLite makes it wait for `other`
        _wait_until(lambda: store._lock.locked(), "the write started")
        seen: list[JobRecord | None] = []
        reader = threading.Thread(target=lambda: seen.append(store.get("video_a")))
        reader.start()
        reader.join(timeout=60)
        # answered while the write still waits (before the fix it waited for the write, which failed after SQLite's
        # busy timeout, 5 s): the last committed state
        assert writer.is_alive(), "the read was answered only after the write gave up"
        assert [r.status if r else None for r in seen] == [QUEUED]
        assert store.counts()[QUEUED] == 1 and [r.id for r in store.page(limit=5)[0]] == ["video_a"]
    finally:
        other.rollback()
        other.close()
        writer.join(timeout=60)
    record = store.get("video_a")
    assert record is not None and record.status == "in_progress"  # the write went through once the lock was free
    store.close()


# A server front end with no engine loop (jobs stay queued), in a fresh interpreter: which modules does the first
# request of each kind import? The client is the standard library's, imported before the count starts.
FIRST_REQUESTS = r"""
import encodings.idna, http.client, json, stringprep, sys, tempfile, time  # the client's (getaddrinfo encodes with idna)
from distvideo.config import EngineConfig
from distvideo.executors import resolve_engine
from distvideo.models.embedded import tiny_model_path
from distvideo.serving.options import ServeOptions
from distvideo.serving.server import Frontend

engine = resolve_engine(EngineConfig(model=str(tiny_model_path()), executor="inline"))
options = ServeOptions(port=0, output=tempfile.mkdtemp(), max_queue=8)
front = Frontend(engine, options, {})
front.start_http(engine, options)
front.service.set_ready()
while not front.http.server.started:  # uvicorn's own start (it imports its protocol modules) is not a request's
    time.sleep(0.01)
host, port = front.sock.getsockname()[:2]
imported = {}

def first(label, method, path, body=None):
    before = set(sys.modules)
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
    response = connection.getresponse()
    data = response.readline() if label == "events" else response.read()
    while label == "events" and not data.startswith(b"data:"):
        data = response.readline()
    connection.close()
    imported[label] = sorted(set(sys.modules) - before)
    return data

first("health", "GET", "/health")
video = json.loads(first("create", "POST", "/v1/videos", json.dumps({"prompt": "a boat", "size": "48x32"})))
first("status", "GET", f"/v1/videos/{video['id']}")
first("events", "GET", f"/v1/videos/{video['id']}/events")
first("list", "GET", "/v1/videos")
front.close()
print(json.dumps(imported))
"""


def test_the_first_request_of_each_kind_imports_nothing():
    done = subprocess.run(
        [sys.executable, "-c", FIRST_REQUESTS], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(imported) == {"health", "create", "status", "events", "list"}, imported
    assert {label: modules for label, modules in imported.items() if modules} == {}
