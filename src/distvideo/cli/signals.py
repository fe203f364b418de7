"""Stop signals for the command line: SIGTERM is handled like Ctrl-C so cleanup runs, and a stop that cleanup cannot
finish (a peer that will never answer) still ends the process (the hard exit)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM (a launcher or scheduler stopping the job), handled like Ctrl-C so cleanup runs."""

    exit_code = 143


_HARD_EXIT_AFTER_S = 8.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_hard_exit_lock = threading.Lock()
_hard_exit_armed = False


def _arm_hard_exit(signum: int) -> None:
    """Cleanup (shutting down workers, destroying the process group) runs as the exception unwinds; if it is stuck
    (a peer that will never answer), end the process anyway so a stop never hangs. Armed once, by the first signal."""
    global _hard_exit_armed
    with _hard_exit_lock:
        if _hard_exit_armed:
            return
        _hard_exit_armed = True
    timer = threading.Timer(_HARD_EXIT_AFTER_S, os._exit, args=(128 + signum,))
    timer.daemon = True
    timer.start()


def _on_signal(signum: int, frame: Any) -> None:
    _arm_hard_exit(signum)
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


class _SignalWatch:
    """Arms the hard exit the moment a stop signal arrives, also while the main thread is blocked in native code (a
    collective waiting for a peer), where Python cannot run `_on_signal` until the call returns, which may be only at
    dist_timeout. The interpreter's C-level handler writes each signal's number to the wakeup fd at once; a thread
    reads it."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="distvideo-signal-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closing:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            for signum in data:
                if signum in _STOP_SIGNALS:
                    _arm_hard_exit(signum)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        self._closing = True
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"\0")  # wake the thread, which then leaves
        self._thread.join(timeout=1.0)
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def install_signal_handlers() -> dict[int, Any]:
    """Route SIGTERM and SIGINT through `_on_signal`, and watch for them (`_SignalWatch`); returns what
    `restore_signal_handlers` needs."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[Any, Any] = {sig: signal.signal(sig, _on_signal) for sig in _STOP_SIGNALS}
    try:
        previous["watch"] = _SignalWatch()
    except (OSError, ValueError):  # no pipe, or a wakeup fd this process cannot replace: the handlers still work
        pass
    return previous


def restore_signal_handlers(previous: dict[Any, Any]) -> None:
    watch = previous.pop("watch", None)
    if watch is not None:
        watch.close()
    for sig, handler in previous.items():
        signal.signal(sig, handler)
