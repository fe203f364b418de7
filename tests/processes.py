"""Processes started by tests: watching pids go, and a command whose output lines are read as they come.

Shared by the test modules (tests/ is on sys.path: ``from processes import Running, gone, wait_gone``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import psutil
import pytest

from background import OUTPUT_THREAD_NAME, in_background, popen


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its parent counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: Iterable[int], within: float) -> list[int]:
    """The pids still alive after up to `within` seconds (returns as soon as every one is gone)."""
    pids = list(pids)
    deadline = time.monotonic() + within
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if not gone(p)]


class Running:
    """A command started in its own session (like a program started from a terminal), its output read line by line
    by threads, so reading never blocks on a full pipe: stdout and stderr merged in ``lines``, or with
    ``separate_stderr`` stdout in ``lines`` and stderr in ``stderr``. Use as a context manager, or call ``kill()`` in
    a ``finally``: the whole session is SIGKILLed."""

    def __init__(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        *,
        separate_stderr: bool = False,
    ):
        self.proc = popen(  # in a background job: at nice 19 (background.py)
            [str(c) for c in cmd],
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if separate_stderr else subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        name = OUTPUT_THREAD_NAME if in_background() else None  # a test counting its threads leaves these out
        self.reader = threading.Thread(target=self._read, name=name, daemon=True)
        self.reader.start()
        self._stderr_reader: threading.Thread | None = None
        if separate_stderr:
            self._stderr_reader = threading.Thread(target=self._read_stderr, name=name, daemon=True)
            self._stderr_reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr.extend(self.proc.stderr)

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def text(self) -> str:
        """Everything printed so far (stdout, then stderr when they are kept apart)."""
        return "".join(self.lines) + "".join(self.stderr)

    def wait_for(self, predicate: Callable[[list[str]], bool], within: float) -> None:
        """Wait until `predicate(lines so far)` holds; fail the test (killing the command) if it has not within
        `within` seconds or the command ended first."""
        deadline = time.monotonic() + within
        while not predicate(list(self.lines)):
            if time.monotonic() > deadline or (self.proc.poll() is not None and not self.reader.is_alive()):
                self.kill()
                pytest.fail(f"not seen within {within} s:\n{self.text()}", pytrace=False)
            time.sleep(0.05)

    def read_line(self, within: float) -> str:
        """The next line of output, waiting up to `within` seconds (fails the test, killing the command)."""
        try:
            return self._queue.get(timeout=within)
        except queue.Empty:
            self.kill()
            pytest.fail(f"the command printed nothing more in {within} s; output:\n{self.text()}", pytrace=False)

    def wait(self, within: float) -> int:
        returncode = self.proc.wait(within)
        self._join_readers()
        return returncode

    def _join_readers(self) -> None:
        self.reader.join(5)
        if self._stderr_reader is not None:
            self._stderr_reader.join(5)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._join_readers()
