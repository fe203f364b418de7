"""Whole programs that a test only checks the outcome of (a smoke run, a script on a cluster of its own, a process
signalled while it waits), run in the background while the rest of the suite runs, so that the second core, which
single-threaded phases of other tests leave idle, does their work.

A module names them in BACKGROUND_JOBS, fixture name -> (start, stop), that is ``{"name": JOB.hooks}`` (conftest.py
calls `start` when collection ends for a collected test that uses the fixture, or with "name[id]" one whose parameter
id has that part; and `stop` at the session's end). The jobs run one after another, in the order they were started,
in one daemon thread, and every program they start runs at nice 19: only on what the tests in the foreground leave
idle. The fixture (``name = JOB.fixture("name")``, or one of the module's own) calls `result()`: a job not yet begun
is run there and then (so a test that comes first, or runs on its own, needs nothing else); one under way is waited
for, and meanwhile a second thread begins the next queued job, so the core the waiting test leaves idle works too
(a cold compile or a single-process smoke run, claimed early, left one core idle for 20 to 40 s). A job only computes: it returns what the test checks, and the test asserts and prints its
figures itself (output of the thread would land in whichever test is running). A job must not use pytest's fixtures
(tmp_path, monkeypatch) or anything another test changes (the session's Ray cluster, the local Slurm, whose ranks
slurmstepd starts, out of reach of nice): it makes its own temporary folder (FolderJob), builds what a session fixture
would have built in a process of its own (run_python), and takes its environment from the copy of os.environ it is
given, made when it was queued (never os.environ itself, which the test running meanwhile may have changed). A test
whose job must use a fixture's bytes checks that they are (LoRA files, MagCache ratios)."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import psutil
import pytest

T = TypeVar("T")

_lock = threading.Lock()
_queue: queue.SimpleQueue[BackgroundJob] = queue.SimpleQueue()
_worker: list[threading.Thread] = []
_running = threading.Event()  # a job runs in a background thread (the worker, or a helper while a test waits)
_active = 0  # how many jobs run in background threads (under _pause)
_helping = threading.Lock()  # held by the one helper thread there may be
THREAD_NAME = "background-jobs"  # the worker's name; every thread of the background's is named "background-..."
OUTPUT_THREAD_NAME = "background-output"  # a thread reading a job's program's output


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
                _worker.append(threading.Thread(target=_run_queue, name=THREAD_NAME, daemon=True))
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
        elif not self._done.is_set() and _helping.acquire(blocking=False):
            threading.Thread(target=_help_while_waiting, args=(self._done,), name=THREAD_NAME, daemon=True).start()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    @property
    def hooks(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """(start, stop): a module's BACKGROUND_JOBS entry, ``{fixture_name: job.hooks}``."""
        return self.start, self.stop

    def fixture(self, name: str, scope: str = "function") -> Any:
        """A pytest fixture named `name` whose value is the job's result: ``name = JOB.fixture("name")``."""

        def result() -> T:
            return self.result()

        result.__name__ = name
        return pytest.fixture(scope=scope, name=name)(result)  # type: ignore[call-overload]

    def _claim_queued(self) -> bool:
        with _lock:
            if self._state != "queued":
                return False
            self._state = "running"
            return True

    def _run(self) -> None:
        began = time.monotonic()
        in_worker = in_background()
        try:
            environ = self._environ if self._environ is not None else dict(os.environ)
            self._value = self._work(self._stopping, environ)
        except BaseException as exc:  # handed to the test that asks for the result
            self._error = exc
        finally:
            self.seconds = time.monotonic() - began
            with _lock:
                self._state = "done"
            self._done.set()
            if in_worker:
                global _active
                with _pause:
                    _active -= 1
                    if not _active:
                        _running.clear()
                    _pause.notify_all()


class FolderJob(BackgroundJob[tuple[Path, T]]):
    """A job that works in a temporary folder of its own: ``work(folder, environ)``; its value is (folder, what work
    returned). The folder is removed when the session stops the job (a fixture reads the files in it until then)."""

    def __init__(self, name: str, prefix: str, work: Callable[[Path, dict[str, str]], T]) -> None:
        self._folders: list[Path] = []

        def in_folder(stopping: threading.Event, environ: dict[str, str]) -> tuple[Path, T]:
            folder = Path(tempfile.mkdtemp(prefix=f"distvideo-{prefix}-"))
            self._folders.append(folder)
            return folder, work(folder, environ)

        super().__init__(name, in_folder)

    def stop(self) -> None:
        super().stop()
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)


def run_python(
    code: str, args: Sequence[str], environ: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python -c code args` with the job's environment (a job builds what a session fixture would have built, in a
    process of its own: the GIL stays with the foreground); fails the job when it exits non-zero."""
    proc = run_program([sys.executable, "-c", code, *args], threading.Event(), timeout, env=environ)
    assert proc.returncode == 0, proc.stderr
    return proc


def in_a_process(module: str, function: str, timeout: float = 600) -> Callable[[Path, dict[str, str]], Any]:
    """A FolderJob's work: ``module.function(folder)`` (a test module's, imported from the tests folder) in a process
    of its own, which returns its CompletedProcess; for work that must not share this process (a cold compile, a
    process's own figures)."""

    def work(folder: Path, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
        path = os.pathsep.join(filter(None, [str(Path(__file__).parent), environ.get("PYTHONPATH")]))
        code = f"import sys, pathlib, {module}; {module}.{function}(pathlib.Path(sys.argv[1]))"
        cmd = [sys.executable, "-c", code, str(folder)]
        return run_program(cmd, threading.Event(), timeout, env={**environ, "PYTHONPATH": path})

    return work


#: `run_python(BUILD_CHECKPOINT, [folder], environ)`: the session's test_checkpoint (conftest.py), the same bytes
BUILD_CHECKPOINT = "import sys; from distvideo.testing.checkpoints import build_test_checkpoint as b; b(sys.argv[1])"


def _begin(job: BackgroundJob) -> bool:
    """Claim a queued job for a background thread, once no pause holds (under _pause); False if a test claimed it."""
    global _active
    with _pause:
        while _pauses:
            _pause.wait()
        claimed = job._claim_queued()
        if claimed:
            _active += 1
            _running.set()
    return claimed


def _run_queue() -> None:
    while True:
        job = _queue.get()
        if _begin(job):
            job._run()


def _help_while_waiting(waited: threading.Event) -> None:
    """While a test waits for a job under way: the next queued jobs, one after another, until the awaited job is done
    (each one begun runs to its end)."""
    try:
        while not waited.is_set():
            try:
                job = _queue.get_nowait()
            except queue.Empty:
                return
            if _begin(job):
                job._run()
    finally:
        _helping.release()


_pause = threading.Condition()
_pauses = 0


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No background job runs inside: those running are waited for, and none begins until the block ends (for a test
    that counts this process's threads and file descriptors, which a job's readers and pipes would change)."""
    global _pauses
    with _pause:
        _pauses += 1
        while _running.is_set():
            _pause.wait()
    try:
        yield
    finally:
        with _pause:
            _pauses -= 1
            _pause.notify_all()


# Every program a job starts runs at nice 19 (`popen`), and so do its children: a job takes only what the test
# in the foreground leaves idle. At nice 0 it took a core from in-process generations, whose two intra-op threads then
# wait for each other: 0.3 s a generation became 1 to 2 s (the demo model's 24 captions, 50 s instead of 8). The
# threads of this process stay at nice 0: a niced thread that wants the GIL makes the thread holding it wait until the
# niced one has been scheduled, which a busy machine delays by seconds (seen: a 0.3 s generation took 2 to 14 s).
BACKGROUND_NICE = 19


def in_background() -> bool:
    """Whether the caller runs in the background jobs' thread (the launchers' helpers ask, to start niced programs)."""
    return threading.current_thread().name == THREAD_NAME


_spawning = threading.Lock()  # held while the worker thread starts a program, until its pid is recorded
_started: set[int] = set()  # the programs the worker thread started


def popen(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen; in the background jobs' thread the program runs under `nice -n 19` (the same pid: nice execs
    it), and its pid is recorded for `foreground_children`."""
    if not in_background():
        return subprocess.Popen(list(cmd), **kwargs)
    with _spawning:
        proc = subprocess.Popen(["nice", "-n", str(BACKGROUND_NICE), *cmd], **kwargs)
        _started.add(proc.pid)
    return proc


def foreground_children() -> list[psutil.Process]:
    """This process's descendants but those of the background jobs (a test counting the processes it leaves behind
    must not count a job's, which come and go meanwhile)."""
    with _spawning:  # never while a job's program is started but not yet recorded
        children = psutil.Process().children(recursive=True)
        started = set(_started)
    by_pid = {child.pid: child for child in children}

    def of_a_job(child: psutil.Process) -> bool:
        pid = child.pid
        while pid in by_pid:
            if pid in started:
                return True
            try:
                pid = by_pid[pid].ppid()
            except psutil.Error:
                return False
        return False

    return [child for child in children if not of_a_job(child)]


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
    cmd: list[str], stopping: threading.Event, timeout: float, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """subprocess.run with its output captured, also ended (killed) when the session stops the job. A program past its
    timeout is killed too, with every process of its session, and raises subprocess.TimeoutExpired, as subprocess.run does."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "start_new_session": True}
    with popen(cmd, **pipes, **kwargs) as proc:
        # stdout and stderr each read to the end by its own thread, so neither pipe fills up and blocks the program
        results: dict[int, str] = {}
        readers = [
            threading.Thread(
                target=lambda i=i, s=s: results.__setitem__(i, s.read()), name=OUTPUT_THREAD_NAME, daemon=True
            )
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
