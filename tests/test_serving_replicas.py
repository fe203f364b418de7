"""`distvideo serve --replicas 2` under mp on a real server (issue 29): two jobs really run at once (both past their
first step while each is held there), each replica shows its job in /health and /metrics, the same request gives the
same video bytes on either replica and as a single-rank run, a job that raises fails alone and its replica goes on,
DELETE stops a running job on its replica, and SIGTERM drains both replicas within the grace. One server, one scenario
(its steps depend on each other: the held jobs are released once)."""

from __future__ import annotations

import hashlib
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from serving_harness import HELD, SMALL, Served, jobs_in_store, start_server

LONG = {**SMALL, "num_inference_steps": 120}  # slowed down by the harness: 6 s or more whatever the machine


def read_events(server: Served, video_id: str) -> list[dict[str, Any]]:
    """Every event of a finished job's stream (replayed, then ended by the server)."""
    with server.http.stream("GET", f"/v1/videos/{video_id}/events") as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[len("data:") :]) for line in response.iter_lines() if line.startswith("data:")]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def single_rank_video(tmp: Path, prompt: str, body: dict) -> str:
    """The same request on one inline rank (the replicas' own layout: one rank each)."""
    from distvideo import VideoGenerator

    width, height = (int(v) for v in body["size"].split("x"))
    with VideoGenerator.from_pretrained(executor="inline", progress=False) as gen:
        result = gen.generate(
            prompt,
            width=width,
            height=height,
            num_frames=body["num_frames"],
            num_inference_steps=body["num_inference_steps"],
            seed=body["seed"],
            output_path=str(tmp / "reference.mp4"),
        )
    assert result.video_path is not None
    return digest(Path(result.video_path))


def busy_jobs(server: Served) -> dict[int, str | None]:
    health = server.http.get("/health").json()
    return {r["replica"]: r["job"] for r in health["replicas"]}


def wait_until(check, what: str, server: Served, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout:g} s:\n{server.log()[-4000:]}")
        time.sleep(0.05)


def metric(server: Served, name: str) -> float:
    for line in server.http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_request_adapters_with_replicas_exit_2_before_anything_starts(tmp_path, capsys):
    from distvideo.cli.main import main

    adapter = tmp_path / "style.safetensors"
    adapter.touch()
    output = tmp_path / "out"
    argv = ["serve", "--executor", "mp", "--num-gpus", "2", "--replicas", "2", "--port", "0", "--output", str(output)]
    assert main([*argv, "--lora-adapter", f"style={adapter}"]) == 2
    message = capsys.readouterr().err
    assert "--lora-adapter with --replicas 2" in message and "--replicas 1" in message, message
    assert not output.exists()  # refused before the store, the port or a rank


@pytest.mark.slow
def test_two_replicas_under_mp(tmp_path):
    with start_server(tmp_path, "mp", args=["--replicas", "2"], hold=True, fail_rank="all") as server:
        # two held jobs: each waits after its first step until released, so both past step 1 means both run at once
        first = server.create(prompt="hold the engine", **HELD)
        second = server.create(prompt="hold the engine", **HELD)
        for job in (first, second):
            assert server.wait_progress(job["id"])["status"] == "in_progress"
        assert sorted(filter(None, busy_jobs(server).values())) == sorted([first["id"], second["id"]])
        assert metric(server, "distvideo_replicas_busy") == 2
        queued = server.create(prompt="a red ball", **SMALL)  # both replicas busy: it waits in the queue
        assert server.get(queued["id"])["status"] == "queued"
        server.release()
        done = [server.wait(job["id"]) for job in (first, second, queued)]
        assert [d["status"] for d in done] == ["completed"] * 3, done
        started = [
            e for e in read_events(server, first["id"]) + read_events(server, second["id"]) if e["type"] == "started"
        ]
        assert sorted(e["replica"] for e in started) == [0, 1], started  # one job on each replica
        progress = [(e["step"], e["steps"]) for e in read_events(server, queued["id"]) if e["type"] == "progress"]
        assert progress == [(1, 2), (2, 2)]
        videos = [server.output / f"{job['id']}.mp4" for job in (first, second)]
        assert digest(videos[0]) == digest(videos[1]) == single_rank_video(tmp_path, "hold the engine", HELD)

        # a job that raises fails alone; its replica runs the next job
        faulty = server.create(prompt="please inject a fault", **SMALL)
        failed = server.wait(faulty["id"])
        assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed", failed
        assert "injected fault" in failed["error"]["message"]
        errors = [r["last_error"] for r in server.http.get("/health").json()["replicas"]]
        assert sum("injected fault" in (e or "") for e in errors) == 1, errors
        after = [server.create(prompt=f"a boat {i}", **SMALL) for i in range(2)]
        assert [server.wait(j["id"])["status"] for j in after] == ["completed"] * 2

        # DELETE stops a running job on its replica at the next step; the other replica goes on
        long = server.create(prompt="a long walk", **LONG)
        server.wait_progress(long["id"])
        beside = server.create(prompt="a short walk", **SMALL)
        assert server.http.delete(f"/v1/videos/{long['id']}").status_code == 202
        stopped = server.wait(long["id"])
        assert stopped["status"] == "failed" and stopped["error"]["code"] == "cancelled", stopped
        assert server.wait(beside["id"])["status"] == "completed"
        health = server.http.get("/health").json()
        assert [r["state"] for r in health["replicas"]] == ["idle", "idle"], health
        assert sum(r["jobs_done"] for r in health["replicas"]) == 8, health
        jobs = {
            line.split("}")[0]: float(line.split()[-1])
            for line in server.http.get("/metrics").text.splitlines()
            if line.startswith("distvideo_replica_jobs_total{")
        }
        assert sum(jobs.values()) == 8 and len(jobs) == 2, jobs

        # SIGTERM: both running jobs finish within the grace, then every rank stops and the server exits 0. The jobs
        # are held after their first step until the server has seen the signal: they are running when it comes.
        server.hold_again()
        draining = [server.create(prompt=f"a drain {i}", **HELD) for i in range(2)]
        for job in draining:
            server.wait_progress(job["id"])
        server.proc.send_signal(signal.SIGTERM)
        server.wait_log("SIGTERM received")
        server.release()
        code = server.wait_exit()
        log = server.log()
        assert code == 0 and "distvideo serve: stopped" in log and "Traceback" not in log, log[-4000:]
        store = jobs_in_store(server.output)
        assert [store[job["id"]][0] for job in draining] == ["completed", "completed"], store
