"""Faults across ranks under real launchers (CPU, gloo, 2 ranks): nothing hangs, nothing is half-written, every
error says what happened. docs/reliability.md states the promises these tests keep and the figures they print.

The ranks run tests/rank_scripts/fault_ranks.py (one scenario per launch, dist_timeout=10 s; 600 s for the rank
failing alone, which must not wait for it). A rank that dies writes the time of its death; the test watches the other
rank's pid and prints how long it outlived its peer ("FIGURE ..." lines, shown with `pytest -s`). Bounds on those
times are generous hang detectors, not benchmarks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from background import BackgroundJob
from conftest import REPO
from launchers import (
    build_launch,
    format_output,
    free_port,
    launcher_env,
    local_slurm,  # noqa: F401
    port_was_taken,
    python_executable,
    require_launcher,
    run_launcher,
    start_local_slurm,
)
from processes import Running, gone

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

SCRIPT = REPO / "tests" / "rank_scripts" / "fault_ranks.py"
DIST_TIMEOUT = 10.0  # fault_ranks.DIST_TIMEOUT
HANG = DIST_TIMEOUT + 20  # "did not hang": well past every bound the code promises, for a loaded 2-core machine
LAUNCH_TIMEOUT = 240
# The fails_alone job runs with dist_timeout 600 s (fault_ranks.LONE_FAILURE_DIST_TIMEOUT). A rank failing alone
# releases the others after the 5 s settling time: bounded far below dist_timeout, and the job is given up (its test
# fails) long before it, so a regression to waiting for dist_timeout fails within LONE_FAILURE_LAUNCH_TIMEOUT.
LONE_FAILURE_BOUND = 60.0
LONE_FAILURE_LAUNCH_TIMEOUT = 150.0


def figure(text: str) -> None:
    print(f"FIGURE {text}", flush=True)


def read_float(path: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        return float(path.read_text())
    return None


def leaked_shared_memory(before: set[str], within: float = 10.0) -> set[str]:
    """Segments in /dev/shm that appeared since `before`, still exist after up to `within` seconds and are mapped by no
    live process: leaked. /dev/shm is the machine's: other test sessions' segments come and go meanwhile (a frames
    segment lives for milliseconds) or are mapped by their processes, and are not counted."""
    deadline = time.monotonic() + within
    while True:
        new = set(os.listdir("/dev/shm")) - before
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    mapped: set[str] = set()
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                mapped |= {line.rsplit("/dev/shm/", 1)[1].strip() for line in maps if "/dev/shm/" in line}
    return {name for name in new if name not in mapped and os.path.exists(f"/dev/shm/{name}")}


# --- starting ranks -------------------------------------------------------------------------------------------------
def hand_started_env(rank: int, world_size: int, port: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """What a user sets to start a rank by hand (no launcher)."""
    values = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return launcher_env({**(env or {}), **values})


class HandStarted:
    """Ranks started with subprocess.Popen, each in its own session, output in OUT/rank<r>.log. Rank 0 binds a
    MASTER_PORT that was free a moment ago: `wait` starts the ranks again on a new port when rank 0 found it taken
    (another process bound it in between), so that race is never reported as the product's failure."""

    def __init__(self, argv: list[str], out: Path, ranks=(0, 1), world_size: int = 2, env=None):
        self.argv, self.out, self.ranks, self.world_size, self.env = argv, out, ranks, world_size, env
        self.logs = [out / f"rank{r}.log" for r in ranks]
        self._start()

    def _start(self) -> None:
        port = free_port()
        self.procs = []
        argv, ranks, world_size, env = self.argv, self.ranks, self.world_size, self.env
        for rank, log in zip(ranks, self.logs, strict=True):
            with open(log, "wb") as f:
                self.procs.append(
                    subprocess.Popen(
                        [python_executable(), *argv],
                        env=hand_started_env(rank, world_size, port, env),
                        stdin=subprocess.DEVNULL,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def wait(self, timeout: float) -> list[int]:
        for attempt in range(3):
            deadline = time.monotonic() + timeout
            try:
                returncodes = [p.wait(max(0.1, deadline - time.monotonic())) for p in self.procs]
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"hand-started ranks still running after {timeout} s\n{self.output()}", pytrace=False)
            if 0 not in self.ranks or attempt == 2 or not port_was_taken(self.logs[0].read_text(errors="replace")):
                return returncodes
            for leftover in self.out.iterdir():  # a clean folder for the new attempt
                if leftover.is_file():
                    leftover.unlink()
            self._start()
        raise AssertionError("unreachable")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:  # a finished rank's group id may already belong to someone else
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def output(self) -> str:
        return "\n".join(f"--- {log.name} ---\n{log.read_text(errors='replace')}" for log in self.logs)


@dataclass
class Outcome:
    returncodes: list[int]  # the launcher's, or each hand-started rank's
    output: str
    out: Path
    killed_at: float | None = None
    exit_after_kill: dict[int, float] = field(default_factory=dict)  # surviving rank -> seconds it outlived the dead
    end_after_kill: float | None = None  # seconds from the death until the launcher (or the last rank) returned

    def error(self, rank: int) -> str:
        path = self.out / f"error{rank}.txt"
        return path.read_text() if path.exists() else ""


def run_scenario(
    launcher: str, scenario: str, out: Path, extra=(), *, victim: int | None = None, kill_on_bad_exit: bool = False
) -> Outcome:
    """Run one scenario on 2 ranks; while it runs, time how long the ranks other than `victim` outlive it."""
    argv = [str(SCRIPT), str(out), scenario, *map(str, extra)]
    finished: dict[str, object] = {}
    hand = HandStarted(argv, out) if launcher == "hand" else None

    def wait() -> None:
        try:
            if hand is not None:
                finished["rcs"] = hand.wait(LAUNCH_TIMEOUT)
                finished["output"] = hand.output()
            else:
                proc = run_launcher(launcher, argv, nproc=2, timeout=LAUNCH_TIMEOUT, kill_on_bad_exit=kill_on_bad_exit)
                finished["rcs"] = [proc.returncode]
                finished["output"] = format_output(proc)
        except BaseException as exc:  # pytest.fail / skip in the thread: re-raised below
            finished["exc"] = exc
        finished["at"] = time.time()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    exited: dict[int, float] = {}
    survivors = [r for r in (0, 1) if r != victim]
    while waiter.is_alive():
        killed_at = read_float(out / "killed_at")
        if killed_at is not None:
            for rank in survivors:
                pid = read_float(out / f"pid{rank}")
                if rank not in exited and pid is not None and gone(int(pid)):
                    exited[rank] = time.time()
        time.sleep(0.05)
    waiter.join()
    if "exc" in finished:
        raise finished["exc"]  # type: ignore[misc]
    for rank in survivors:  # gone between the last look and the launcher's return: the return bounds it
        pid = read_float(out / f"pid{rank}")
        if rank not in exited and pid is not None and gone(int(pid)):
            exited[rank] = finished["at"]  # type: ignore[assignment]
    outcome = Outcome(finished["rcs"], finished["output"], out)  # type: ignore[arg-type]
    outcome.killed_at = read_float(out / "killed_at")
    if outcome.killed_at is not None:
        outcome.exit_after_kill = {r: t - outcome.killed_at for r, t in exited.items()}
        outcome.end_after_kill = finished["at"] - outcome.killed_at  # type: ignore[operator]
    return outcome


# --- a rank dies in the middle of a generation ---------------------------------------------------------------------
DEAD_PEER = [
    # (launcher, srun -K, the rank that dies, scenario)
    pytest.param("hand", False, 1, "peer_dies", id="hand-started"),
    pytest.param("torchrun", False, 1, "peer_dies", id="torchrun"),
    pytest.param("srun", False, 0, "output_rank_dies", id="srun", marks=pytest.mark.slurm),
    pytest.param("srun", True, 1, "peer_dies", id="srun-K", marks=pytest.mark.slurm),
    pytest.param("mpirun", False, 1, "peer_dies", id="mpirun", marks=pytest.mark.mpi),
]


# how each launcher names a rank 1 killed by SIGKILL in its own output
LAUNCHER_REPORTS = {
    "torchrun": "failed (exitcode: -9) local_rank: 1",
    "srun": "task 1: Killed",
    "mpirun": "process rank 1 with PID",
}


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from distvideo.models.embedded import tiny_model_path
    from distvideo.testing.lora_files import build_random_lora

    return build_random_lora(tiny_model_path(), tmp_path_factory.mktemp("lora") / "style.safetensors")


@pytest.mark.parametrize(("launcher", "kill_on_bad_exit", "victim", "scenario"), DEAD_PEER)
def test_survivor_exits_when_a_peer_dies_mid_generation(
    launcher, kill_on_bad_exit, victim, scenario, tmp_path, lora_file
):
    """Rank 1 is SIGKILLed in its 2nd transformer call (rank 0 waits in the CFG all-gather), or rank 0 in the middle of
    encoding the video. The other rank exits non-zero soon after, with an error naming the dead rank where the
    launcher lets it speak (it does not kill it first), and no file is left at or beside the output path."""
    if launcher != "hand":
        require_launcher(launcher)
    out = tmp_path
    (out / "video").mkdir()
    extra = [lora_file] if scenario == "peer_dies" else []
    outcome = run_scenario(launcher, scenario, out, extra, victim=victim, kill_on_bad_exit=kill_on_bad_exit)
    text = outcome.output
    survivor = 1 - victim
    assert outcome.killed_at is not None, f"rank {victim} never reached its death\n{text}"
    name = f"{launcher}{' -K' if kill_on_bad_exit else ''}"
    figure(
        f"dead peer, {name}: rank {survivor} exited {outcome.exit_after_kill.get(survivor, float('nan')):.1f} s after "
        f"rank {victim} was killed; the launch returned after {outcome.end_after_kill:.1f} s"
    )
    if launcher == "hand":
        assert outcome.returncodes[victim] == -signal.SIGKILL and outcome.returncodes[survivor] == 1, text
    else:
        assert outcome.returncodes[0] != 0, text
    assert outcome.exit_after_kill.get(survivor, HANG) < HANG, f"rank {survivor} outlived its peer too long\n{text}"
    error = outcome.error(survivor)
    if error:  # the survivor spoke (a launcher that kills on failure may end it first)
        assert error.startswith("ProcessGroupBrokenError: "), error
        assert f"rank {victim} lost" in error and "the job must be restarted" in error, error
    if launcher in ("hand", "srun") and not kill_on_bad_exit:  # nobody kills the survivor: it must leave by itself
        assert error, f"rank {survivor} did not raise the broken-group error\n{text}"
    if launcher in LAUNCHER_REPORTS and victim == 1:  # the launchers that end the survivor name the dead rank
        assert LAUNCHER_REPORTS[launcher] in text, text
    assert list((out / "video").iterdir()) == [], "a partial or temporary file was left beside the output"
    if scenario == "peer_dies":
        check_refusals_before_the_death(out, text)


def check_refusals_before_the_death(out: Path, text: str) -> None:
    """Divergent calls are refused on both ranks with the same error naming the fields, before any denoising, and
    leave the group usable; dist_timeout reaches every process group."""
    checks = [json.loads((out / f"checks{r}.json").read_text()) for r in (0, 1)]
    assert checks[0] == checks[1], "both ranks must raise the same errors"
    c = checks[0]
    assert "seed: rank 0: 0, rank 1: 1" in c["seed"]
    assert "height: rank 0: 32, rank 1: 48" in c["shape"]
    invalid = c["invalid_on_one_rank"]  # refused on rank 0 too, instead of leaving it waiting for rank 1
    assert "invalid_request: rank 0: None, rank 1: 'height=50 must be a multiple of 16" in invalid
    assert "nickname: rank 0: 'style0', rank 1: 'style1'" in c["lora_nickname"]
    assert "strength: rank 0: 1.0, rank 1: 2.0" in c["lora_strength"]
    for message in (c["seed"], c["shape"], invalid, c["lora_nickname"], c["lora_strength"]):
        assert message.startswith("ranks disagree on the arguments of "), message
    assert c["transformer_calls"] == [0, 0], "a refused request must not reach the transformer"
    assert c["ping"] == [0, 1]
    for timeouts in c["timeouts"]:
        assert set(timeouts) >= {"world", "cpu", "cfg"} and set(timeouts.values()) == {DIST_TIMEOUT}, timeouts


# --- timeouts, and a rank failing on its own ------------------------------------------------------------------------
@dataclass
class Job:
    out: Path
    returncodes: list[int] | None  # None: still running at its time limit (then killed)
    output: str

    def error(self, rank: int) -> str:
        path = self.out / f"error{rank}.txt"
        return path.read_text() if path.exists() else ""

    def seconds(self, start: str, end: str) -> float:
        return read_float(self.out / end) - read_float(self.out / start)  # type: ignore[operator]


# Four hand-started jobs that mostly wait (about 25 s, for dist_timeout and the store client's retries): the stuck
# pair, the pair where rank 1 fails alone, and rank 0 and rank 1 of two other jobs, each started without its peer. They
# start as soon as the session has collected a test that uses `waiting_jobs` (conftest.py runs BACKGROUND_JOBS after
# collection), so their waiting overlaps the rest of the suite; the fixture collects what they left.
WAITING_JOBS = {
    "stuck": ("stuck", (0, 1)),
    "fails_alone": ("fails_alone", (0, 1)),
    "alone0": ("never_joins", (0,)),
    "alone1": ("never_joins", (1,)),
}


@dataclass
class Waiting:
    base: Path
    began: float
    started: dict[str, tuple[Path, HandStarted]]


_waiting: list[Waiting] = []


def start_waiting_jobs() -> None:
    """Start the waiting jobs once per session (a second call finds them started)."""
    if _waiting:
        return
    base = Path(tempfile.mkdtemp(prefix="distvideo-waiting-jobs-"))
    waiting = Waiting(base, time.monotonic(), {})
    _waiting.append(waiting)
    try:
        for name, (scenario, ranks) in WAITING_JOBS.items():
            out = base / name
            out.mkdir()
            waiting.started[name] = (out, HandStarted([str(SCRIPT), str(out), scenario], out, ranks=ranks))
    except BaseException:
        stop_waiting_jobs()
        raise


def stop_waiting_jobs() -> None:
    """Kill whatever is still running and remove the jobs' folder (also at the session's end, by conftest.py)."""
    while _waiting:
        waiting = _waiting.pop()
        for _, job in waiting.started.values():
            job.kill()
        shutil.rmtree(waiting.base, ignore_errors=True)


BACKGROUND_JOBS = {"waiting_jobs": (start_waiting_jobs, stop_waiting_jobs)}


@pytest.fixture(scope="module")
def waiting_jobs() -> Iterator[dict[str, Job]]:
    """The waiting jobs' outcomes, each job given its own time limit from the moment they started."""
    start_waiting_jobs()  # started already, unless the session's hook did not run (then they start now)
    waiting = _waiting[0]
    try:
        jobs = {}
        for name, (out, job) in waiting.started.items():
            limit = LONE_FAILURE_LAUNCH_TIMEOUT if name == "fails_alone" else LAUNCH_TIMEOUT
            try:  # a job past its limit fails its own test, not the others'
                returncodes = job.wait(max(1.0, waiting.began + limit - time.monotonic()))
            except pytest.fail.Exception as exc:
                returncodes = None
                print(f"{name}: {exc}", flush=True)
            jobs[name] = Job(out, returncodes, job.output())
        for _, job in waiting.started.values():  # none is left running when one of them fails the fixture
            job.kill()
        yield jobs
    finally:
        stop_waiting_jobs()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_whose_peer_never_joins_gives_up_with_a_clear_message(rank, waiting_jobs):
    """Rank 0 of 2 started alone gives up after dist_timeout; rank 1 alone after torch's store client has retried its
    connection (about twice dist_timeout). Each names the rendezvous and the timeout."""
    job = waiting_jobs[f"alone{rank}"]
    assert job.returncodes == [1], job.output
    waited = job.seconds(f"start_at{rank}", f"exit_at{rank}")
    figure(f"rank {rank} started alone: gave up {waited:.1f} s after creating its generator (dist_timeout 10 s)")
    assert waited < (HANG if rank == 0 else 2 * DIST_TIMEOUT + 20), job.output
    error = job.error(rank)
    assert f"rank {rank} could not form the process group of 2 ranks through the rendezvous at 127.0.0.1:" in error
    assert "within dist_timeout=10 s" in error and "Every rank must be started" in error, error
    if rank == 0:
        assert "1/2 clients joined" in error, error


def test_a_rank_stuck_outside_a_collective_is_reported(waiting_jobs):
    """Rank 1 sleeps in a collective_rpc callable past dist_timeout while rank 0 waits in the status exchange: rank 0
    reports rank 1 as alive but not responding, after dist_timeout, and leaves; rank 1 then finds rank 0 gone."""
    job = waiting_jobs["stuck"]
    assert job.returncodes == [1, 1], job.output
    waited = job.seconds("call_at0", "exit_at0")
    figure(f"stuck peer, hand-started: rank 0 reported it {waited:.1f} s after the call began (dist_timeout 10 s)")
    assert DIST_TIMEOUT - 1 < waited < HANG, job.output
    error0, error1 = job.error(0), job.error(1)
    assert "rank 1 not responding during collective_rpc('sleep_on_rank_1')" in error0, error0
    assert "rank 1: alive, but did not reach the collective within dist_timeout" in error0, error0
    assert "Timed out" in error0 and "the job must be restarted" in error0, error0
    assert "rank 0 lost" in error1 and "rendezvous store it hosts" in error1, error1


def test_a_rank_failing_alone_mid_generation_releases_the_others(waiting_jobs):
    """Rank 1 raises in its 2nd transformer call while rank 0 waits for it in the CFG all-gather, with dist_timeout 600
    s: rank 1 leaves the group after a short settling time, so rank 0 fails soon after the failure itself (timed from
    the moment rank 1 raised) instead of at dist_timeout; rank 0's error names rank 1's failure."""
    job = waiting_jobs["fails_alone"]
    assert job.returncodes is not None, (
        f"still running {LONE_FAILURE_LAUNCH_TIMEOUT:.0f} s after it began\n{job.output}"
    )
    assert job.returncodes == [1, 1], job.output
    after = job.seconds("failed_at", "exit_at0")
    figure(f"rank failing alone, hand-started: rank 0 exited {after:.1f} s after rank 1 raised (dist_timeout 600 s)")
    assert after < LONE_FAILURE_BOUND, job.output  # far below dist_timeout: it did not wait for it
    error0, error1 = job.error(0), job.error(1)
    assert "execute_forward failed on rank 1 while rank 0 was still inside it" in error1, error1
    assert "rank 1 (this rank): RuntimeError: planted failure in transformer call 2 on rank 1" in error1, error1
    assert "rank 1 failed during execute_forward" in error0, error0
    assert "RuntimeError: planted failure in transformer call 2 on rank 1" in error0, error0


# --- Ctrl-C and SIGTERM ---------------------------------------------------------------------------------------------
SLOW_GENERATE = ["--prompt", "a fox", "--num-frames", "5", "--height", "32", "--width", "32", "--steps", "400"]


def rank_processes(marker: str) -> list[psutil.Process]:
    """Every process whose command line holds `marker` (the output folder: unique to one test)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
                found.append(p)
    return found


def interrupt_mid_generation(running: Running, out: Path, sig: int, ready: Callable[[list[str]], bool]) -> dict:
    """Wait until `ready(output lines)` (ranks are denoising), send `sig` to the launcher, and time how long until the
    launcher and every process of the job (found by pid before the signal) are gone."""
    try:
        running.wait_for(ready, 180)
        launcher = psutil.Process(running.proc.pid)
        # the launcher's descendants, and processes elsewhere naming this test's folder (srun's tasks: slurmstepd's)
        procs = {*launcher.children(recursive=True), *rank_processes(str(out))} - {launcher}
        assert len(procs) >= 2, f"expected the rank processes\n{running.text()}"
        sent = time.monotonic()
        os.kill(running.proc.pid, sig)
        returncode = running.proc.wait(60)  # Popen reaps the launcher itself (psutil must not, or its code is lost)
        _, alive = psutil.wait_procs(list(procs), timeout=60)
        stopped_s = time.monotonic() - sent
        running.wait(10)
    finally:
        running.kill()
    return {"stopped_s": stopped_s, "alive": alive, "returncode": returncode, "text": running.text(), "procs": procs}


def steps_after(marker: str | None, ranks: int) -> Callable[[list[str]], bool]:
    """Ready when every one of `ranks` ranks printed "step <rank>" (after the line starting with `marker`)."""

    def ready(lines: list[str]) -> bool:
        if marker is not None:
            starts = [i for i, line in enumerate(lines) if line.startswith(marker)]
            lines = lines[starts[0] + 1 :] if starts else []
        return len({line for line in lines if line.startswith("step ")}) >= ranks

    return ready


SIGNALS = [
    pytest.param("torchrun", signal.SIGINT, id="torchrun-ctrl-c"),
    pytest.param("srun", signal.SIGTERM, id="srun-sigterm", marks=pytest.mark.slurm),
]


@pytest.mark.parametrize(("launcher", "sig"), SIGNALS)
def test_interrupt_under_a_launcher_stops_every_rank(launcher, sig, tmp_path):
    """`distvideo generate` under a launcher, mid-denoising: a stop signal to the launcher ends every rank (and the
    launcher) soon (measured 1.4-5.7 s; bounded here at 30 s, a hang detector), with no process left behind and no
    video written. torchrun forwards Ctrl-C to the ranks,
    whose CLI cleans up: each destroys its process group. srun ends its tasks itself."""
    require_launcher(launcher)
    env = {"FAULT_SLOW_TRANSFORMER_S": "0.2", "DISTVIDEO_LOG_LEVEL": "DEBUG"}
    if launcher == "srun":
        env.update(start_local_slurm())
    argv = [str(SCRIPT), str(tmp_path), "slow_cli", *SLOW_GENERATE, "--output", str(tmp_path / "video.mp4")]
    argv += ["--dist-timeout", str(DIST_TIMEOUT)]
    cmd, child_env = build_launch(launcher, argv, 2, env, timeout=LAUNCH_TIMEOUT, job_name=f"faults-{tmp_path.name}")
    result = interrupt_mid_generation(Running(cmd, child_env), tmp_path, sig, steps_after(None, 2))
    text = result["text"]
    figure(f"{signal.Signals(sig).name} to {launcher}: every process gone {result['stopped_s']:.1f} s later")
    assert result["alive"] == [], f"left behind: {result['alive']}\n{text}"
    assert result["stopped_s"] < 30, text
    if launcher == "torchrun":  # torchrun forwards the signal: each rank's CLI reports it and cleans up
        assert result["returncode"] != 0, text
        assert text.count("distvideo: interrupted (SIGINT); stopped") == 2, text
        assert "[rank 0] DEBUG distvideo.worker: rank 0: process group destroyed" in text, text
        assert "[rank 1] DEBUG distvideo.worker: rank 1: process group destroyed" in text, text
    assert not (tmp_path / "video.mp4").exists()
    assert [p.name for p in tmp_path.iterdir()] == [], "nothing may be written beside the output"


BLOCKED_IN_NATIVE_CODE = """
import sys
from datetime import timedelta
import torch.distributed as dist
from distvideo.cli.main import install_signal_handlers
install_signal_handlers()
# waits in C++ for a rank 1 that never comes: Python cannot run a signal handler until this returns (after 120 s)
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=2, timeout=timedelta(seconds=120))
"""


def _signal_while_blocked(stopping: threading.Event, environ: dict[str, str]) -> tuple[int | None, float, str]:
    """Rank 0 alone waiting in gloo's rendezvous, SIGTERMed: its return code (None: still running 110 s later), the
    seconds from the signal to its exit (0 if it was never signalled), and its output."""
    tmp = Path(tempfile.mkdtemp(prefix="distvideo-blocked-"))
    rendezvous = tmp / "rendezvous"  # a file store: rank 0 writes its address there, then waits in C++
    cmd = [python_executable(), "-c", BLOCKED_IN_NATIVE_CODE, f"file://{rendezvous}"]
    try:
        with Running(cmd, launcher_env(base=environ)) as running:
            deadline = time.monotonic() + 120
            while not (rendezvous.exists() and rendezvous.stat().st_size > 0):
                if running.proc.poll() is not None or time.monotonic() > deadline or stopping.is_set():
                    return running.proc.poll(), 0.0, running.text()
                time.sleep(0.05)
            sent = time.monotonic()
            running.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                running.proc.wait(110)
            return running.proc.poll(), time.monotonic() - sent, running.text()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# about 9 s, nearly all of it waiting for the signal watch's grace: in the background (background.py)
BLOCKED = BackgroundJob("SIGTERM while blocked in native code", _signal_while_blocked)
BACKGROUND_JOBS["blocked_and_signalled"] = BLOCKED.hooks


@pytest.fixture
def blocked_and_signalled() -> tuple[int | None, float, str]:
    return BLOCKED.result()


def test_a_stop_signal_ends_the_cli_while_it_is_blocked_in_native_code(blocked_and_signalled):
    """SIGTERM while the main thread waits inside torch.distributed for a peer that never answers: the CLI's signal
    watch still ends the process after its 8 s grace (exit 143), instead of when the wait times out (120 s)."""
    returncode, stopped_s, text = blocked_and_signalled
    figure(f"SIGTERM while blocked in a collective's native wait: process gone {stopped_s:.1f} s later")
    # 143: the signal watch's hard exit, which comes 8 s after the signal; 60 s only tells it from the 120 s wait
    assert returncode == 143 and 0 < stopped_s < 60, text


def test_mp_executor_worker_death_and_sigterm(tmp_path):
    """The mp executor, one driver process: (1) rank 1 is SIGKILLed in the middle of a generation: the driver raises
    an error naming it and tears rank 0 down, and nothing of theirs stays in /dev/shm; (2) `distvideo generate --executor mp --num-gpus 2`, mid-denoising:
    SIGTERM to the driver stops it and both workers soon (exit code 143; bounded at 30 s, a hang detector), leaving no process and no video."""
    argv = [str(SCRIPT), str(tmp_path), "mp_faults", *SLOW_GENERATE, "--output", str(tmp_path / "video.mp4")]
    argv += ["--executor", "mp", "--num-gpus", "2"]
    shm_before = set(os.listdir("/dev/shm"))
    running = Running([python_executable(), *argv], launcher_env({"FAULT_SLOW_TRANSFORMER_S": "0.05"}))
    try:
        mp_faults_checks(running, tmp_path, shm_before)
    finally:
        running.kill()


def mp_faults_checks(running: Running, tmp_path: Path, shm_before: set[str]) -> None:
    running.wait_for(lambda lines: any(line.startswith("died ") for line in lines), 180)
    lines = running.text().splitlines()
    workers = json.loads(next(line for line in lines if line.startswith("workers "))[len("workers ") :])
    _, died_at, error = next(line for line in lines if line.startswith("died ")).split(" ", 2)
    killed_at = read_float(tmp_path / "killed_at")
    assert killed_at is not None, running.text()
    figure(f"mp worker killed mid-generation: the driver raised {float(died_at) - killed_at:.1f} s later")
    assert error.startswith("WorkerDiedError: rank 1 died (killed by SIGKILL) during collective_rpc("), error
    assert "SIGKILL often comes from the kernel's out-of-memory killer" in error, error
    assert psutil.wait_procs([psutil.Process(pid) for pid in workers if not gone(pid)], timeout=30)[1] == []
    (tmp_path / "killed_at").unlink()

    result = interrupt_mid_generation(running, tmp_path, signal.SIGTERM, steps_after("died ", 2))
    text = result["text"]
    figure(f"SIGTERM to the mp driver: driver and workers gone {result['stopped_s']:.1f} s later")
    assert result["returncode"] == 143 and "distvideo: interrupted (SIGTERM); stopped" in text, text
    assert len(result["procs"]) >= 2, "the driver's two workers (and multiprocessing's resource tracker)"
    assert result["alive"] == [] and result["stopped_s"] < 30, text
    assert [p.name for p in tmp_path.iterdir()] == []
    # a SIGKILLed worker leaves nothing behind: no named semaphore or shared-memory segment, so no warning at exit
    assert "resource_tracker" not in text and "leaked" not in text, text
    assert leaked_shared_memory(shm_before) == set()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
