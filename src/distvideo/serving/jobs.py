"""What the HTTP handlers and the engine loop share: the bounded queue of admitted jobs, the service's health, the
request to cancel the running job, and the counters behind /metrics. Handlers only enqueue and read; the engine loop
alone takes jobs and drives the engine."""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distvideo.request import ResolvedRequest

LOADING, OK, STOPPING, UNHEALTHY = "loading", "ok", "stopping", "unhealthy"


@dataclass
class QueuedJob:
    id: str
    request: ResolvedRequest
    lora: tuple[str, float] | None = None
    client: str = ""  # who submitted it (which API key): jobs are taken round-robin across clients


class QueueFull(Exception):
    pass


class ServiceClosed(Exception):
    pass


@dataclass
class Counters:
    """Monotonic counts and sums for /metrics (Prometheus counters)."""

    submitted: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: {"queue_full": 0, "invalid": 0, "stopping": 0})
    finished: dict[str, int] = field(default_factory=lambda: {"completed": 0, "failed": 0, "cancelled": 0})
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stage_count: dict[str, int] = field(default_factory=dict)


class Service:
    """Thread-safe state of one server: a bounded queue of admitted jobs, health, the running job and counters.

    The queue is fair across clients: each client (API key) has its own FIFO, and `take` serves the clients in turn,
    so one client's hundred jobs do not starve another's one. With one client (or none) it is one FIFO. The bound
    counts every client's jobs together."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._cond = threading.Condition()
        # client -> its jobs in arrival order; the client served next is first (a served client moves to the end)
        self._queue: collections.OrderedDict[str, collections.deque[QueuedJob]] = collections.OrderedDict()
        self._closed = False
        self.health, self.health_detail = LOADING, "loading the model"
        self.running: str | None = None
        self._cancel_running: str | None = None  # the running job's id once a client asked to cancel it
        self.counters = Counters()
        self._recent_seconds: collections.deque[float] = collections.deque(maxlen=20)

    # -- handlers' side ------------------------------------------------------------------------------
    def enqueue(self, job: QueuedJob) -> int:
        """Append a job; returns its position (0: next). QueueFull or ServiceClosed otherwise."""
        with self._cond:
            if self._closed:
                self.counters.rejected["stopping"] += 1
                raise ServiceClosed(self.health_detail)
            if self._depth() >= self.max_queue:
                self.counters.rejected["queue_full"] += 1
                raise QueueFull()
            self._queue.setdefault(job.client, collections.deque()).append(job)
            self.counters.submitted += 1
            self._cond.notify_all()
            return self._depth() - 1

    def _depth(self) -> int:
        return sum(len(jobs) for jobs in self._queue.values())

    def remove_queued(self, job_id: str) -> bool:
        with self._cond:
            for client, jobs in self._queue.items():
                for job in jobs:
                    if job.id == job_id:
                        jobs.remove(job)
                        if not jobs:
                            del self._queue[client]
                        return True
            return False

    def request_cancel(self, job_id: str) -> bool:
        """Ask the engine loop to stop `job_id` if it is the running job; True if it is."""
        with self._cond:
            if self.running != job_id:
                return False
            self._cancel_running = job_id
            return True

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the recent mean job time (5 s before any job finished)."""
        with self._cond:
            mean = sum(self._recent_seconds) / len(self._recent_seconds) if self._recent_seconds else 5.0
        return max(1, math.ceil(mean))

    @property
    def depth(self) -> int:
        with self._cond:
            return self._depth()

    @property
    def accepting(self) -> bool:
        with self._cond:
            return not self._closed

    # -- engine loop's side ----------------------------------------------------------------------
    def take(self) -> QueuedJob | None:
        """The next job, waiting for one; None once the service is closed (what is still queued stays for `drain`)."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            client, jobs = next(iter(self._queue.items()))
            job = jobs.popleft()
            del self._queue[client]
            if jobs:  # this client waits for every other client's turn
                self._queue[client] = jobs
            self.running, self._cancel_running = job.id, None
            return job

    def cancel_requested(self, job_id: str) -> bool:
        with self._cond:
            return self._cancel_running == job_id

    def finished(self, job_id: str, outcome: str, seconds: float, timings: dict[str, float]) -> None:
        with self._cond:
            self.running, self._cancel_running = None, None
            self.counters.finished[outcome] = self.counters.finished.get(outcome, 0) + 1
            if outcome == "completed":
                self._recent_seconds.append(seconds)
            for stage, value in timings.items():
                self.counters.stage_seconds[stage] = self.counters.stage_seconds.get(stage, 0.0) + value
                self.counters.stage_count[stage] = self.counters.stage_count.get(stage, 0) + 1

    def close(self, health: str, detail: str) -> list[QueuedJob]:
        """Stop admission (and wake the engine loop); returns the jobs that were still queued. Unhealthy wins over
        stopping."""
        with self._cond:
            if not (self.health == UNHEALTHY and health != UNHEALTHY):
                self.health, self.health_detail = health, detail
            self._closed = True
            left = [job for jobs in self._queue.values() for job in jobs]
            self._queue.clear()
            self._cond.notify_all()
            return left

    def set_ready(self) -> None:
        with self._cond:
            if not self._closed:
                self.health, self.health_detail = OK, None  # type: ignore[assignment]
