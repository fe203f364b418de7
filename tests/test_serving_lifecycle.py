"""The service's life on real servers: SIGTERM under inline and torchrun (the running job finishes within the grace
period, or is cancelled after it; queued jobs fail; every rank exits, with 0), a restart over the same output folder
(finished jobs still listed and downloadable, interrupted ones failed with the reason), and a rank that dies (the
job fails, /health turns unhealthy, the process exits 1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest

from distvideo import EngineConfig, VideoGenerator
from distvideo.executors import resolve_engine
from distvideo.serving.adapters import Adapters
from distvideo.serving.options import ServeLimits, ServeOptions
from distvideo.serving.runner import EngineLoop
from distvideo.serving.server import Frontend

from launchers import console_script
from serving_harness import (
    FAULTS,
    HELD,
    SLOW_STEP_ENV,
    SMALL,
    assert_stopped_cleanly,
    jobs_in_store,
    start_server,
)

LONG = {"size": "48x32", "num_frames": 5, "num_inference_steps": 400, "seed": 1}


def launched_ranks(server) -> list[psutil.Process]:
    """The rank processes torchrun started (its children running distvideo), in rank order."""
    children = [p for p in psutil.Process(server.proc.pid).children() if "serve" in " ".join(p.cmdline())]
    return sorted(children, key=lambda p: int(p.environ().get("RANK", "-1")))


@pytest.mark.parametrize(
    "executor",
    [
        pytest.param("inline", marks=pytest.mark.slow),
        pytest.param("torchrun", marks=[pytest.mark.launcher, pytest.mark.slow]),
    ],
)
def test_sigterm_lets_the_running_job_finish_fails_the_queued_and_exits_0(tmp_path, executor):
    """The running job is held after its first step (HELD) until the test saw the server stopping, so it cannot end
    before the signal, nor outlast the grace period. The drain is the server's, whatever runs the ranks: in process
    (inline) and launched (torchrun) here; an mp server stops on SIGTERM at the end of every test_serving_api.py run
    (its running job cancelled after the grace period), and mp's workers end with their driver
    (test_mp_executor.py)."""
    with start_server(tmp_path, executor, hold=True) as server:
        running = server.create(prompt="finish me", **HELD)
        queued = server.create(prompt="never started", **SMALL)
        server.wait_progress(running["id"])
        ranks = launched_ranks(server) if executor == "torchrun" else []
        assert len(ranks) == (2 if executor == "torchrun" else 0)
        server.proc.send_signal(signal.SIGTERM)
        stopping = server.wait_health("stopping")
        # torchrun forwards the signal to both ranks: the reason is rank 0's own, or rank 1's when its stop request
        # reached rank 0 first (docs/serving.md, Shutdown)
        reason = (
            r"shutting down \((rank 1 received )?SIGTERM\)" if executor == "torchrun" else r"shutting down \(SIGTERM\)"
        )
        assert stopping.status_code == 503 and re.search(reason, stopping.json()["detail"]), stopping.text
        assert server.get(queued["id"])["error"]["code"] == "server_shutdown"
        refused = server.http.post("/v1/videos", json={"prompt": "too late", **SMALL})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable", refused.text
        assert server.get(running["id"])["status"] == "in_progress"
        server.release()
        code = server.wait_exit()
        log = server.log()
    assert_stopped_cleanly(executor, code, log)
    jobs = jobs_in_store(server.output)
    assert jobs[running["id"]] == ("completed", None, None), log
    assert (server.output / f"{running['id']}.mp4").is_file()
    status, error_code, message = jobs[queued["id"]]
    assert (status, error_code) == ("failed", "server_shutdown") and "before this job started" in message
    for rank in ranks:
        assert not rank.is_running()


@pytest.mark.slow  # a server started and stopped (or two): not in `make test-fast`
def test_a_second_signal_cancels_the_running_job_at_once(tmp_path):
    """SIGTERM gives the running job the grace period (60 s here; it needs 20 s or more); SIGINT while stopping ends
    it after its current step. A job past the grace period is cancelled on every executor: test_serving_api's servers
    check it as they stop."""
    with start_server(tmp_path, "inline") as server:
        running = server.create(prompt="stopped by the second signal", **LONG)
        server.wait_progress(running["id"])
        server.proc.send_signal(signal.SIGTERM)
        server.wait_health("stopping")
        code = server.stop(signal.SIGINT)
        log = server.log()
    assert_stopped_cleanly("inline", code, log)
    assert "SIGINT received (2 times)" in log, log
    status, error_code, message = jobs_in_store(server.output)[running["id"]]
    assert (status, error_code) == ("failed", "server_shutdown"), log
    assert "grace period of 0 s" in message and "every rank stopped after step" in message, message
    assert list(server.output.glob("*.mp4")) == []


@pytest.mark.slow  # a server started and stopped (or two): not in `make test-fast`
def test_a_restarted_server_lists_finished_jobs_and_fails_interrupted_ones(tmp_path):
    output = tmp_path / "out"
    with start_server(tmp_path / "first", "inline", output=output) as first:
        done = first.wait(first.create(prompt="kept", **SMALL)["id"])
        content = first.http.get(f"/v1/videos/{done['id']}/content").content
        second_server = subprocess.run(
            [console_script("distvideo"), "serve", "--port", "0", "--output", str(output)],
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        assert second_server.returncode == 2 and "another distvideo serve uses this folder" in second_server.stderr
        interrupted = first.create(prompt="interrupted", **LONG)
        first.wait_progress(interrupted["id"])
        queued = first.create(prompt="queued when it died", **SMALL)
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL  # a crash: nothing cleaned up
    # the second server also ends by the forced exit: see the end
    forced = {"DISTVIDEO_TEST_HARD_EXIT_MARGIN_S": "1"}  # instead of 30 s (serving_faults)
    with start_server(
        tmp_path / "second", "inline", output=output, hold=True, env=forced, args=["--shutdown-grace", "0"]
    ) as second:
        listed = {v["id"]: v for v in second.http.get("/v1/videos").json()["data"]}
        assert set(listed) == {done["id"], interrupted["id"], queued["id"]}
        assert listed[done["id"]]["status"] == "completed"
        assert second.http.get(f"/v1/videos/{done['id']}/content").content == content
        for job_id in (interrupted["id"], queued["id"]):
            assert listed[job_id]["status"] == "failed"
            assert listed[job_id]["error"]["code"] == "server_restarted"
            assert "submit it again" in listed[job_id]["error"]["message"]
        assert second.wait(second.create(prompt="after the restart", **SMALL)["id"])["status"] == "completed"
        # a shutdown that cannot finish (a step that never ends, held and never released) ends the process anyway,
        # with 1, --shutdown-grace + HARD_EXIT_MARGIN_S after the signal
        stuck = second.create(prompt="a step that never ends", **HELD)
        second.wait_progress(stuck["id"])
        code = second.stop(signal.SIGTERM)
        log = second.log()
    assert code == 1 and "SIGTERM received" in log and "distvideo serve: stopped" not in log, log
    assert jobs_in_store(output)[stuck["id"]][0] == "in_progress"  # nothing after the step ran


@pytest.mark.launcher
@pytest.mark.slow
def test_a_dead_launched_rank_fails_the_job_and_the_launch_exits_nonzero(tmp_path):
    with start_server(tmp_path, "torchrun") as server:
        running = server.create(prompt="doomed", **LONG)
        server.wait_progress(running["id"])
        launched_ranks(server)[1].kill()
        code = server.wait_exit()
        log = server.log()
    assert code != 0, log
    status, error_code, message = jobs_in_store(server.output)[running["id"]]
    assert status == "failed" and error_code == "engine_failure", (status, error_code, message, log)
    assert "ProcessGroupBrokenError" in message


@pytest.mark.slow
def test_health_from_loading_to_unhealthy_when_an_mp_worker_dies(tmp_path, monkeypatch):
    """In this process, so the test decides when the HTTP server stops: /health says "loading" until the model is
    loaded; after a worker died the engine loop returns 1 (`distvideo serve`'s exit code), the running and the queued
    job fail, and the server, still up, says why."""
    for name, value in SLOW_STEP_ENV.items():  # the spawned workers slow the long job down
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(
        "DISTVIDEO_MP_START", "spawn"
    )  # new interpreters run the sitecustomize; forked workers would not
    engine = resolve_engine(EngineConfig(executor="mp", num_gpus=2))
    options = ServeOptions(port=0, output=str(tmp_path), limits=ServeLimits(max_steps=1000))
    front = Frontend(engine, options, {})
    front.start_http(engine, options)
    assert front.http is not None
    loading = httpx.get(front.http.url + "/health", timeout=60)  # the port is open before the model loads
    assert loading.status_code == 503 and loading.json()["status"] == "loading", loading.text
    gen = VideoGenerator.from_engine(engine)
    workers = [psutil.Process(pid) for pid in gen.collective_rpc(lambda worker: os.getpid())]  # however they started
    try:
        loop = front.loop = EngineLoop(gen, front.service, front.store, Adapters(gen, [], {}))
        front.service.set_ready()
        codes: list[int] = []
        thread = threading.Thread(target=lambda: codes.append(loop.run()), daemon=True)
        thread.start()
        with httpx.Client(base_url=front.http.url, timeout=60) as client:
            assert client.get("/health").json()["status"] == "ok"
            job = client.post("/v1/videos", json={"prompt": "doomed", **LONG}).json()
            queued = client.post("/v1/videos", json={"prompt": "never runs", **SMALL}).json()
            deadline = time.monotonic() + 300
            while client.get(f"/v1/videos/{job['id']}").json()["progress"] < 1:
                assert time.monotonic() < deadline, "no progress"
                time.sleep(0.05)
            workers[-1].kill()
            thread.join(timeout=120)
            assert codes == [1]
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "unhealthy"
            assert "WorkerDiedError" in health.json()["detail"]
            failed = client.get(f"/v1/videos/{job['id']}").json()["error"]
            assert failed["code"] == "engine_failure" and "WorkerDiedError" in failed["message"]
            assert client.get(f"/v1/videos/{queued['id']}").json()["error"]["code"] == "engine_failure"
            refused = client.post("/v1/videos", json={"prompt": "too late", **SMALL})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
    finally:
        front.service.close("stopping", "the test ended")  # the loop returns if it is still waiting for a job
        gen.shutdown()
        front.close()


@pytest.mark.slow
def test_health_turns_unhealthy_when_an_idle_mp_worker_dies(tmp_path):
    """No job runs when the worker dies: /health says so within seconds (the mp executor's monitor thread saw it) and
    the engine loop returns 1, without waiting for a job to find the dead worker."""
    engine = resolve_engine(EngineConfig(executor="mp", num_gpus=2))
    options = ServeOptions(port=0, output=str(tmp_path))
    front = Frontend(engine, options, {})
    front.start_http(engine, options)
    assert front.http is not None
    gen = VideoGenerator.from_engine(engine)
    workers = [psutil.Process(pid) for pid in gen.collective_rpc(lambda worker: os.getpid())]  # however they started
    try:
        loop = front.loop = EngineLoop(gen, front.service, front.store, Adapters(gen, [], {}))
        front.service.set_ready()
        codes: list[int] = []
        thread = threading.Thread(target=lambda: codes.append(loop.run()), daemon=True)
        thread.start()
        with httpx.Client(base_url=front.http.url, timeout=60) as client:
            assert client.get("/health").json()["status"] == "ok"
            workers[-1].kill()
            thread.join(timeout=15)
            assert codes == [1], "the engine loop still waits for a job with a dead worker"
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "unhealthy"
            assert "WorkerDiedError" in health.json()["detail"] and "between calls" in health.json()["detail"]
    finally:
        front.service.close("stopping", "the test ended")
        gen.shutdown()
        front.close()


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher",
    [pytest.param("srun", marks=pytest.mark.slurm), pytest.param("mpirun", marks=pytest.mark.mpi)],
)
def test_srun_and_mpirun_serve_and_stop_on_sigterm(tmp_path, launcher):
    """Rank 0 hosts the rendezvous store under srun and mpirun (torchrun's agent does under torchrun): jobs reach rank
    1 through it, and at shutdown rank 0 waits until rank 1 read the stop before it exits with the store."""
    with start_server(tmp_path, launcher, fail_rank="all") as server:
        assert server.http.get("/health").json()["world_size"] == 2
        failed = server.wait(server.create(prompt="please inject a fault", **SMALL)["id"])
        assert failed["status"] == "failed", failed
        done = server.wait(server.create(prompt="under " + launcher, **SMALL)["id"])
        assert done["status"] == "completed", done
        if launcher == "srun":
            # as Slurm stops a step (scancel, the time limit, --signal=TERM@T): SIGTERM to every task; srun itself
            # answers a SIGTERM by killing the step
            tasks = [
                p for p in psutil.process_iter(["cmdline"]) if str(server.output) in " ".join(p.info["cmdline"] or [])
            ]
            tasks = [p for p in tasks if p.info["cmdline"][0] != "srun"]  # srun and its helper
            assert len(tasks) == 2, [p.info["cmdline"] for p in tasks]
            for task in tasks:
                task.send_signal(signal.SIGTERM)
            code = server.wait_exit()
        else:
            code = server.stop(signal.SIGTERM)  # mpirun forwards it to every rank
        log = server.log()
    assert "distvideo serve: stopped (rank 0)" in log and "distvideo serve: rank 1 stopped" in log, log
    assert "ProcessGroupBrokenError" not in log and "Traceback" not in log, log
    # srun exits with its tasks' code; mpirun, like torchrun, reports that it was signalled whatever the ranks did
    assert code == (0 if launcher == "srun" else 1), log
