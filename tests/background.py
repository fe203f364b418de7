"""Whole programs that a test only checks the outcome of (a smoke run, a script on a cluster of its own, a process
signalled while it waits), run in the background while the rest of the suite runs, so that the second core, which
single-threaded phases of other tests leave idle, does their work.

A module names them in BACKGROUND_JOBS, fixture name -> (start, stop) (conftest.py calls `start` when collection ends
for a collected test that uses the fixture, and `stop` at the session's end). The jobs run one after another, in the
order they were started, in one daemon thread, and every program they start runs at nice 19: never two at once, and
only on what the tests in the foreground leave idle. The
fixture calls `result()`: a job not yet begun is run there and then (so a test that comes first, or runs on its own,
needs nothing else); one under way is waited for. A job only computes: it returns what the test checks, and the test
asserts and prints its figures itself (output of the thread would land in whichever test is running). A job must not
use pytest's fixtures (tmp_path, monkeypatch) or anything another test changes (the session's Ray cluster, the local
Slurm): it makes its own temporary folder, and takes its environment from the copy of os.environ it is given, made
when it was queued (never os.environ itself, which the test running meanwhile may have changed)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import psutil

T = TypeVar("T")

_lock = threading.Lock()
_queue: queue.SimpleQueue[BackgroundJob] = queue.SimpleQueue()
_worker: list[threading.Thread] = []
_running = threading.Event()  # a job runs in the worker thread


class BackgroundJob(Generic[T]):
    def __init__(self, name: str, work: Callable[[threading.Event, dict[str, str]], T]) -> None:
        self.name = name
        self._work = work
        self._state = "new"  # new -> queued -> running -> done (or new/queued -> stopped)
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0  # how long the work took, wherever it ran
        self._environ: dict[str, str] | None = None

    def start(self) -> None:
        """Queue the job behind those started before it (once; a second call does nothing)."""
        with _lock:
            if self._state != "new":
                return
            self._state = "queued"
            self._environ = dict(os.environ)  # as it is before any test runs: a test's monkeypatch must not leak in
            if not _worker:
                _worker.append(threading.Thread(target=_run_queue, name="background-jobs", daemon=True))
                _worker[0].start()
                threading.Thread(target=_renice_sessions, name="background-sessions", daemon=True).start()
        _queue.put(self)

    def stop(self) -> None:
        """At the session's end: a job not begun never begins; one under way is stopped, its processes killed."""
        with _lock:
            running = self._state == "running"
            if self._state in ("new", "queued"):
                self._state = "stopped"
                self._error = RuntimeError(f"background job {self.name!r} was stopped before it began")
                self._done.set()
        self._stopping.set()
        if running:
            _kill_background_processes()
            self._done.wait(30)

    def result(self) -> T:
        """The job's value, running it here if it has not begun; its exception, if it raised one."""
        with _lock:
            claimed = self._state in ("new", "queued")
            if claimed:
                self._state = "running"
        if claimed:
            self._run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def _claim_queued(self) -> bool:
        with _lock:
            if self._state != "queued":
                return False
            self._state = "running"
            return True

    def _run(self) -> None:
        began = time.monotonic()
        in_worker = in_background()
        if in_worker:
            _running.set()
        try:
            environ = self._environ if self._environ is not None else dict(os.environ)
            self._value = self._work(self._stopping, environ)
        except BaseException as exc:  # handed to the test that asks for the result
            self._error = exc
        finally:
            self.seconds = time.monotonic() - began
            with _lock:
                self._state = "done"
            if in_worker:
                _running.clear()
            self._done.set()


def _run_queue() -> None:
    while True:
        job = _queue.get()
        if job._claim_queued():
            job._run()


# Every program a job starts runs at nice 19 (`nice_prefix()`), and so do its children: a job takes only what the test
# in the foreground leaves idle. At nice 0 it took a core from in-process generations, whose two intra-op threads then
# wait for each other: 0.3 s a generation became 1 to 2 s (the demo model's 24 captions, 50 s instead of 8). The
# threads of this process stay at nice 0: a niced thread that wants the GIL makes the thread holding it wait until the
# niced one has been scheduled, which a busy machine delays by seconds (seen: a 0.3 s generation took 2 to 14 s).
BACKGROUND_NICE = 19


def in_background() -> bool:
    """Whether the caller runs in the background jobs' thread (the launchers' helpers ask, to start niced programs)."""
    return threading.current_thread().name == "background-jobs"


def nice_prefix() -> list[str]:
    """What to put before a command the caller starts: `nice -n 19` in the background jobs' thread, else nothing."""
    return ["nice", "-n", str(BACKGROUND_NICE)] if in_background() else []


def _autogroup(pid: int | str) -> tuple[str, int] | None:
    """(autogroup, its nice value) of a process, None where the kernel has no autogroups or the process is gone."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            group, _, nice = f.read().split()  # "/autogroup-2319 nice 0"
        return group, int(nice)
    except (OSError, ValueError):
        return None


def _renice_sessions() -> None:
    """With autogroups (Linux's default on desktops and many VMs), the scheduler first shares the cores between
    sessions, and a nice value only counts inside its own session: the programs a job starts in sessions of their own
    (a launcher, torchrun's ranks, Ray's processes) would take a full share beside the foreground's. So every process
    this one started (directly or not) that runs at BACKGROUND_NICE in another session than this process's gets its
    session's nice value set to the same, as soon as it is seen (polled 5 times a second, only while a job runs)."""
    own = _autogroup("self")
    if own is None:
        return
    while True:
        if _running.wait():
            for process in psutil.Process().children(recursive=True):  # ours only, never another program's
                niced = False
                with contextlib.suppress(psutil.Error):
                    niced = process.nice() == BACKGROUND_NICE
                group = _autogroup(process.pid) if niced else None
                if group is not None and group[0] != own[0] and group[1] != BACKGROUND_NICE:
                    with contextlib.suppress(OSError):
                        with open(f"/proc/{process.pid}/autogroup", "w") as f:
                            f.write(str(BACKGROUND_NICE))
        time.sleep(0.2)


def _kill_background_processes() -> None:
    """Every process the worker thread started, and theirs: those, and only those, run at nice 19."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.nice() == 19:
                child.kill()


def run_program(
    cmd: list[str], stopping: threading.Event, timeout: float, **popen: object
) -> subprocess.CompletedProcess[str]:
    """subprocess.run with its output captured, also ended (killed) when the session stops the job. A program past its
    timeout is killed too, with every process of its session, and raises subprocess.TimeoutExpired, as subprocess.run does."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "start_new_session": True}
    with subprocess.Popen([*nice_prefix(), *cmd], **pipes, **popen) as proc:  # type: ignore[call-overload]
        # stdout and stderr each read to the end by its own thread, so neither pipe fills up and blocks the program
        results: dict[int, str] = {}
        readers = [
            threading.Thread(target=lambda i=i, s=s: results.__setitem__(i, s.read()), daemon=True)
            for i, s in enumerate((proc.stdout, proc.stderr))
        ]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if stopping.is_set() or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):  # its children too (ranks, a cluster's processes)
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                for reader in readers:
                    reader.join()
                if stopping.is_set():
                    raise RuntimeError(f"stopped at the session's end: {cmd}")
                raise subprocess.TimeoutExpired(cmd, timeout, results.get(0), results.get(1))
            stopping.wait(0.1)
        for reader in readers:
            reader.join()
        return subprocess.CompletedProcess(cmd, proc.returncode, results.get(0, ""), results.get(1, ""))
