"""What each replica of the service is doing, for /health and /metrics: idle or busy with which job, jobs done,
seconds busy, the last error. The engine loop (one replica) or the replica pool (several) writes it; handlers read."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Literal


@dataclass
class ReplicaState:
    replica: int
    job: str | None = None  # the running job's id; None: idle
    started: float | None = None  # monotonic time the job started
    jobs_done: int = 0  # jobs that ended here (completed, failed or cancelled)
    jobs_completed: int = 0
    busy_seconds: float = 0.0  # summed over the jobs that ended here
    last_error: str | None = None

    @property
    def state(self) -> Literal["idle", "busy"]:
        return "idle" if self.job is None else "busy"


class ReplicaBoard:
    def __init__(self, replicas: int):
        self._lock = threading.Lock()
        self._states = [ReplicaState(r) for r in range(replicas)]

    @property
    def replicas(self) -> int:
        return len(self._states)

    def start(self, replica: int, job_id: str) -> None:
        with self._lock:
            state = self._states[replica]
            state.job, state.started = job_id, time.monotonic()

    def finish(self, replica: int, outcome: str, error: str | None = None) -> float:
        """The replica's job ended (`outcome`: completed, failed, cancelled); returns the seconds it ran."""
        with self._lock:
            state = self._states[replica]
            seconds = time.monotonic() - state.started if state.started is not None else 0.0
            state.job, state.started = None, None
            state.jobs_done += 1
            state.jobs_completed += outcome == "completed"
            state.busy_seconds += seconds
            if error is not None:
                state.last_error = error
            return seconds

    def idle(self) -> list[int]:
        with self._lock:
            return [s.replica for s in self._states if s.job is None]

    def running(self) -> dict[str, int]:
        """job id -> the replica running it."""
        with self._lock:
            return {s.job: s.replica for s in self._states if s.job is not None}

    def snapshot(self) -> list[ReplicaState]:
        with self._lock:
            now = time.monotonic()
            out = []
            for s in self._states:
                extra = now - s.started if s.started is not None else 0.0
                out.append(
                    ReplicaState(
                        s.replica, s.job, s.started, s.jobs_done, s.jobs_completed, s.busy_seconds + extra, s.last_error
                    )
                )
            return out
