"""Load on a real server (inline, embedded model): 10 concurrent clients submit 40 jobs against a queue of 4; every
job ends completed or was refused with 429, nothing is lost or duplicated. The status latency while generating is
reported (printed, and written beside the server's outputs), never asserted: figures belong in docs/serving.md, from
`benchmarks/serve_load.py`."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from background import FolderJob, in_a_process
from conftest import REPO
from launchers import format_output
from serving_harness import start_server


def load_module():
    spec = importlib.util.spec_from_file_location("serve_load", REPO / "benchmarks" / "serve_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_to(folder: Path) -> None:
    """The load and the list of jobs after it, in a process of its own (LOAD): FOLDER/outcome.json."""
    serve_load = load_module()
    with start_server(folder / "serve", "inline", args=["--max-queue", "4"]) as server:
        report = serve_load.run_load(server.url, clients=10, jobs=40)
        listed = server.http.get("/v1/videos", params={"limit": 100}).json()["data"]
    (folder / "outcome.json").write_text(json.dumps({"report": report, "listed": listed}))


# a whole server under load (about 11 s) whose outcome is all the test checks: in the background, in a process of its
# own (its server runs at the job's nice 19; every wait in it is a deadline of 120 s or more)
LOAD = FolderJob("10 clients, 40 jobs on a served engine", "serve-load", in_a_process("test_serving_load", "load_to"))
BACKGROUND_JOBS = {"load_outcome": LOAD.hooks}


@pytest.fixture
def load_outcome() -> dict:
    folder, proc = LOAD.result()
    assert proc.returncode == 0, format_output(proc)
    return json.loads((folder / "outcome.json").read_text())


@pytest.mark.slow
def test_ten_clients_forty_jobs_nothing_lost_or_duplicated(tmp_path, load_outcome):
    report, listed = load_outcome["report"], load_outcome["listed"]
    accepted = report.pop("accepted_ids")
    print("load report:", json.dumps(report))
    (tmp_path / "load_report.json").write_text(json.dumps(report, indent=2))
    assert report["errors"] == []
    assert report["accepted"] + report["refused_429"] == 40
    assert report["completed"] == report["accepted"] and report["failed"] == 0 and report["lost"] == 0
    assert report["duplicated_ids"] == 0 and len(set(accepted)) == len(accepted)
    assert sorted(v["id"] for v in listed) == sorted(accepted)  # the store holds each admitted job once, no other
    assert all(v["status"] == "completed" for v in listed)
    assert report["status_latency_while_generating_ms"]["samples"] > 0
