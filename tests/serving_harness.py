"""Run `distvideo serve` as a real process (alone, with its mp workers, or as 2 ranks under torchrun) on a loopback port
the server chose itself (--port 0; it prints the port), and talk to it with a real HTTP client.

    with start_server(tmp_path, "torchrun", api_key=KEY) as server:
        video = server.create(prompt="a boat", size="48x32", num_frames=5, num_inference_steps=2)
        done = server.wait(video["id"])
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from launchers import _kill_tree, build_launch, console_script, launcher_env, require_launcher, start_local_slurm

FAULTS = Path(__file__).resolve().parent / "serving_faults"  # sitecustomize: fault injection, slow long jobs
SLOW_STEP_ENV = {"DISTVIDEO_TEST_SLOW_STEP_S": "0.05"}  # jobs of 100+ steps: 5 s or more, whatever the machine
START_TIMEOUT_S = 300.0
TERMINAL = ("completed", "failed")
SMALL = {"size": "48x32", "num_frames": 5, "num_inference_steps": 2, "seed": 3}  # a job of about a second
# with start_server(..., hold=True): waits after its first step until `Served.release()` (serving_faults)
HELD = {"size": "48x32", "num_frames": 5, "num_inference_steps": 7, "seed": 2}


class Served:
    def __init__(self, proc: subprocess.Popen, log: Path, output: Path, api_key: str | None, release: Path):
        self.proc, self.log_path, self.output, self.api_key = proc, log, output, api_key
        self.release_path = release
        self.url = ""
        self.client: httpx.Client | None = None

    # -- life ------------------------------------------------------------------------------------
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode} before it was ready:\n{self.log()}")
            text = self.log()
            if not self.url and (match := re.search(r"listening on (http://\S+)", text)):
                self.url = match.group(1)
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                self.client = httpx.Client(base_url=self.url, headers=headers, timeout=60.0)
            if "distvideo serve: ready" in text:
                return
            time.sleep(0.1)
        pytest.fail(f"the server was not ready within {timeout:g} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Send `sig` to the server (the launcher under torchrun) and return its exit code."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {timeout:g} s after signal {sig}:\n{self.log()}")

    def wait_exit(self, timeout: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {timeout:g} s:\n{self.log()}")

    def release(self) -> None:
        """Let the held job (HELD, on a server started with hold=True) go on after its first step."""
        self.release_path.touch()

    def hold_again(self) -> None:
        """After `release()`: HELD jobs created from now on wait after their first step again, until the next release."""
        self.release_path.unlink(missing_ok=True)

    def wait_log(self, text: str, count: int = 1, timeout: float = 60.0) -> str:
        """Poll the server's log until `text` is in it `count` times (a deadline, not a delay); the log."""
        deadline = time.monotonic() + timeout
        while (log := self.log()).count(text) < count:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"the log never said {text!r} {count} time(s):\n{log[-4000:]}")
            time.sleep(0.05)
        return log

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc.poll() is None:
            _kill_tree(self.proc.pid, grace=2.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    # -- HTTP ------------------------------------------------------------------------------------
    @property
    def http(self) -> httpx.Client:
        assert self.client is not None
        return self.client

    def create(self, **body: Any) -> dict[str, Any]:
        response = self.http.post("/v1/videos", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def get(self, video_id: str) -> dict[str, Any]:
        response = self.http.get(f"/v1/videos/{video_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, video_id: str, until: Sequence[str] = TERMINAL, timeout: float = 300.0) -> dict[str, Any]:
        """Poll the job until its status is one of `until` (a deadline, not a delay: it returns as soon as it is)."""
        deadline = time.monotonic() + timeout
        while True:
            video = self.get(video_id)
            if video["status"] in until:
                return video
            if time.monotonic() > deadline:
                pytest.fail(f"job {video_id} still {video['status']} after {timeout:g} s:\n{self.log()[-4000:]}")
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited ({self.proc.returncode}) while job {video_id} was {video['status']}")
            time.sleep(0.05)

    def wait_progress(self, video_id: str, at_least: int = 1, timeout: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            video = self.get(video_id)
            if video["status"] in TERMINAL or (video["status"] == "in_progress" and video["progress"] >= at_least):
                return video
            if time.monotonic() > deadline:
                pytest.fail(f"job {video_id} made no progress in {timeout:g} s:\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def wait_health(self, status: str, timeout: float = 120.0) -> httpx.Response:
        """Poll /health until it says `status` (a deadline, not a delay)."""
        deadline = time.monotonic() + timeout
        while True:
            response = self.http.get("/health")
            if response.json()["status"] == status:
                return response
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"/health never said {status!r} (last: {response.text}):\n{self.log()[-4000:]}")
            time.sleep(0.02)


def jobs_in_store(output: Path) -> dict[str, tuple[str, str | None, str | None]]:
    """id -> (status, error code, error message), read from the store file after the server exited."""
    with sqlite3.connect(f"file:{output / 'jobs.sqlite3'}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT id, status, error_code, error_message FROM videos").fetchall()
    return {row[0]: (row[1], row[2], row[3]) for row in rows}


def assert_stopped_cleanly(executor: str, code: int, log: str) -> None:
    """Exit 0 on every rank after SIGTERM. torchrun itself exits 1 after a SIGTERM whatever its workers did (it raises
    SignalException by design); there each rank's own line says it stopped, and torchrun had no rank to kill."""
    if executor != "torchrun":
        assert code == 0 and "distvideo serve: stopped" in log and "Traceback" not in log, log
        return
    assert code == 1 and "SignalException" in log, log
    assert "distvideo serve: stopped (rank 0)" in log and "distvideo serve: rank 1 stopped" in log, log
    assert "SIGKILL" not in log and "ERROR" not in log, log


def server_command(executor: str, args: Sequence[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    distvideo = console_script("distvideo")
    if executor in ("torchrun", "srun", "mpirun"):
        require_launcher(executor)
        if executor == "srun":
            env = {**start_local_slurm(), **env}
        return build_launch(executor, [distvideo, "serve", *args], nproc=2, env=env, python=False)
    engine = ["--executor", executor, "--num-gpus", "2"] if executor in ("mp", "ray") else ["--executor", "inline"]
    return [distvideo, "serve", *engine, *args], launcher_env(env)


@contextlib.contextmanager
def start_server(
    workdir: Path,
    executor: str,
    *,
    args: Sequence[str] = (),
    api_key: str | None = None,
    output: Path | None = None,
    env: dict[str, str] | None = None,
    fail_rank: str | None = None,
    hold: bool = False,
) -> Iterator[Served]:
    output = output or workdir / "out"
    workdir.mkdir(parents=True, exist_ok=True)
    flags = [
        "--port",
        "0",
        "--output",
        str(output),
        "--no-progress",
        "--shutdown-grace",
        "60",
        "--max-steps",
        "900",
        *args,
    ]
    child_env = {"DISTVIDEO_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1", **SLOW_STEP_ENV, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))
    if api_key:
        child_env["DISTVIDEO_API_KEY"] = api_key  # not on the command line
    if fail_rank is not None:
        child_env["DISTVIDEO_TEST_FAIL_RANK"] = fail_rank
    stamp = time.monotonic_ns()
    release = workdir / f"release-{stamp}"
    if hold:
        child_env["DISTVIDEO_TEST_HOLD_FILE"] = str(release)
    cmd, full_env = server_command(executor, flags, child_env)
    log = workdir / f"server-{executor}-{stamp}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env, start_new_session=True
        )
    served = Served(proc, log, output, api_key, release)
    try:
        served._await_ready(START_TIMEOUT_S)
        yield served
    finally:
        served.close()
