"""The graceful stop that both engine loops share (one replica: runner.py; several: pool.py): admission stops, the
queued jobs fail, the running ones get a grace period, after which the loop's own `on_late` cancels them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from distvideo.serving.jobs import STOPPING, Service
from distvideo.serving.store import JobStore


class Drain:
    """A loop's stop: the first reason, the grace period and when it ends (None until a stop began). Thread-safe."""

    def __init__(self, service: Service, store: JobStore, on_late: Callable[[], None], log: logging.Logger):
        self.service, self.store, self.on_late, self.log = service, store, on_late, log
        self.reason: str | None = None
        self.grace = 0.0
        self.deadline: float | None = None  # once stopping: when the running jobs are cancelled
        self._lock = threading.Lock()

    def begin(self, reason: str, grace: float) -> None:
        """Stop admission, fail the queued jobs, give the running ones `grace` seconds, then call `on_late`.
        Idempotent; the first reason stays, a later call may only shorten the grace."""
        with self._lock:
            first = self.reason is None
            self.reason = self.reason or reason
            deadline = time.monotonic() + grace
            if self.deadline is not None and self.deadline <= deadline:
                return
            self.deadline, self.grace = deadline, grace
        left = self.service.close(STOPPING, f"shutting down ({reason})")
        if first:
            self.log.info("shutting down (%s): admission stopped, %d queued job(s) failed", reason, len(left))
        for job in left:
            self.store.mark_failed(
                job.id, "server_shutdown", f"the server shut down ({reason}) before this job started"
            )
        timer = threading.Timer(grace, self.on_late)
        timer.daemon = True
        timer.start()

    def late(self) -> bool:
        """Whether the grace period is over (the running jobs should stop at their next step)."""
        deadline = self.deadline
        return deadline is not None and time.monotonic() >= deadline

    def why_stopped(self, error: object) -> tuple[str, str] | None:
        """The error code and message of a job cancelled because the service stopped (None if it is not stopping)."""
        if self.reason is None:
            return None
        return "server_shutdown", (
            f"the server shut down ({self.reason}) and the job did not finish within the grace period of "
            f"{self.grace:g} s ({error})"
        )
