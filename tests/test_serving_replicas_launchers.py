"""`distvideo serve --replicas 2` under launchers (issue 29): 2 ranks under torchrun, and under srun on two emulated
nodes (one rank, one replica each). Two held jobs run at once, one on each replica; the same request gives the same
bytes on both; a job that raises fails alone; SIGTERM drains every replica and every rank says it stopped."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launchers import build_launch, console_script, require_launcher, start_local_slurm
from serving_harness import (
    FAULTS,
    HELD,
    SLOW_STEP_ENV,
    SMALL,
    START_TIMEOUT_S,
    Served,
    assert_stopped_cleanly,
    jobs_in_store,
)
from serving_harness import start_server as start_harness_server

pytestmark = [pytest.mark.slow, pytest.mark.launcher]


@contextlib.contextmanager
def start_two_node_server(workdir: Path) -> Iterator[Served]:
    """The harness's server, but under srun with one rank on each of the local Slurm's two nodes."""
    require_launcher("srun")
    output = workdir / "out"
    release = workdir / "release"
    env = {
        **start_local_slurm(),
        "DISTVIDEO_NO_PROGRESS": "1",
        "HF_HUB_OFFLINE": "1",
        **SLOW_STEP_ENV,
        "DISTVIDEO_TEST_HOLD_FILE": str(release),
        "DISTVIDEO_TEST_FAIL_RANK": "all",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])),
    }
    flags = ["--port", "0", "--output", str(output), "--no-progress", "--shutdown-grace", "60", "--replicas", "2"]
    cmd, full_env = build_launch(
        "srun", [console_script("distvideo"), "serve", *flags], nproc=2, env=env, python=False, nodes=2
    )
    log = workdir / "server-srun.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env, start_new_session=True
        )
    served = Served(proc, log, output, None, release)
    try:
        served._await_ready(START_TIMEOUT_S)
        yield served
    finally:
        served.close()


def started_replicas(server: Served, video_id: str) -> list[int]:
    with server.http.stream("GET", f"/v1/videos/{video_id}/events") as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:") and '"started"' in line]
    return [int(line.split('"replica":')[1].split(",")[0].strip("} ")) for line in lines]


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("srun", marks=pytest.mark.slurm)])
def test_two_replicas_under_a_launcher(tmp_path, launcher):
    if launcher == "torchrun":
        context = start_harness_server(tmp_path, "torchrun", args=["--replicas", "2"], hold=True, fail_rank="all")
    else:
        context = start_two_node_server(tmp_path)
    with context as server:
        jobs = [server.create(prompt="hold the engine", **HELD) for _ in range(2)]
        for job in jobs:  # each waits after its first step until released: both past it means both run at once
            assert server.wait_progress(job["id"])["status"] == "in_progress"
        health = server.http.get("/health").json()
        assert sorted(r["job"] for r in health["replicas"]) == sorted(j["id"] for j in jobs), health
        server.release()
        assert [server.wait(j["id"])["status"] for j in jobs] == ["completed"] * 2
        assert sorted(r for j in jobs for r in started_replicas(server, j["id"])) == [0, 1]
        videos = [(server.output / f"{j['id']}.mp4").read_bytes() for j in jobs]
        assert hashlib.sha256(videos[0]).digest() == hashlib.sha256(videos[1]).digest()

        faulty = server.create(prompt="please inject a fault", **SMALL)
        assert server.wait(faulty["id"])["error"]["code"] == "generation_failed"
        assert server.wait(server.create(prompt="a boat", **SMALL)["id"])["status"] == "completed"

        # SIGTERM while both replicas run a job (held after its first step until every rank has seen the signal)
        server.hold_again()
        draining = [server.create(prompt=f"a drain {i}", **HELD) for i in range(2)]
        for job in draining:
            server.wait_progress(job["id"])
        if launcher == "torchrun":
            server.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank
            server.wait_log("SIGTERM received", count=2)
            server.release()
            assert_stopped_cleanly("torchrun", server.wait_exit(), server.log())
        else:
            # as Slurm stops a step: SIGTERM to every task (srun itself answers a SIGTERM by killing the step)
            tasks = [
                p for p in psutil.process_iter(["cmdline"]) if str(server.output) in " ".join(p.info["cmdline"] or [])
            ]
            tasks = [p for p in tasks if p.info["cmdline"][0] != "srun"]
            assert len(tasks) == 2, [p.info["cmdline"] for p in tasks]
            for task in tasks:
                task.send_signal(signal.SIGTERM)
            server.wait_log("SIGTERM received", count=2)
            server.release()
            code, log = server.wait_exit(), server.log()
            assert code == 0, log[-4000:]
            assert "distvideo serve: stopped (rank 0)" in log and "distvideo serve: rank 1 stopped" in log, log
            assert "Traceback" not in log, log
        store = jobs_in_store(server.output)
        assert [store[j["id"]][0] for j in draining] == ["completed", "completed"], store
