"""One call in flight on a driver whose ranks live elsewhere (mp's processes, Ray's actors): the answers gathered so
far, the deadline, and the settling window after a lockstep failure. The drivers differ in how they wait for an
answer (a poller on pipes, `ray.wait`) and how they tear their ranks down; what a call's answers mean, when it is
overdue, and the words of the error are here, once.

An overdue call is data (:class:`Overdue`: what the driver records as the reason it is dead, and the error to raise
once its ranks are gone), so each driver writes one branch: tear down, raise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from distvideo.errors import RankFailure, WorkerDiedError
from distvideo.executors.base import (
    SETTLE_S,
    SHUT_DOWN,
    CallOptions,
    Executor,
    RankStatus,
    collective_error,
    method_name,
    must_settle,
)
from distvideo.executors.mp_wire import remote_traceback

#: a call that limits itself in time (a request's deadline, `self_limit`) and is still unanswered
#: STOP_GRACE_FACTOR x self_limit + STOP_GRACE_S after it started is stuck (a long decode, a hung rank)
STOP_GRACE_FACTOR = 2.0
STOP_GRACE_S = 30.0


def call_timeout(timeout: float | None, options: CallOptions) -> float | None:
    """The call's effective timeout: the caller's, capped for a self-limited call at the point it counts as stuck."""
    if options.self_limit is None:
        return timeout
    stuck = STOP_GRACE_FACTOR * options.self_limit + STOP_GRACE_S
    return stuck if timeout is None else min(timeout, stuck)


@dataclass(frozen=True)
class Overdue:
    """Why a call can no longer complete: `dead` is the driver's record (its later errors quote it), `error` what
    the caller gets once every rank is torn down, `cause` the failed ranks' traceback where there is one."""

    dead: str
    error: Exception
    cause: BaseException | None = None


@dataclass
class CallTracker:
    """The answers of one call over `world_size` ranks; `unit` names what runs a rank in messages ("worker",
    "actor")."""

    method: str | Callable[..., Any]
    world_size: int
    timeout: float | None
    options: CallOptions
    unit: str = "worker"
    label: str | None = None  # the call as messages name it (default: collective_rpc('<method>'))
    statuses: dict[int, RankStatus] = field(default_factory=dict)
    deadline: float | None = None
    settle_end: float | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None:
            self.deadline = time.monotonic() + self.timeout

    @property
    def what(self) -> str:
        return self.label or f"collective_rpc({method_name(self.method)!r})"

    @property
    def pending(self) -> list[int]:
        return [rank for rank in range(self.world_size) if rank not in self.statuses]

    def answer(self, rank: int, status: RankStatus) -> None:
        """Rank `rank` answered: once a rank has failed a lockstep call alone, the others get SETTLE_S."""
        self.statuses[rank] = status
        if self.options.lockstep and must_settle(status) and self.settle_end is None:
            self.settle_end = time.monotonic() + SETTLE_S

    def wait_s(self, slice_s: float) -> float:
        """How long the driver may wait for the next answer: a slice, less where the deadline or settling ends."""
        now = time.monotonic()
        ends = [end - now for end in (self.deadline, self.settle_end) if end is not None]
        return max(0.0, min([slice_s, *ends]))

    def overdue(self) -> Overdue | None:
        """The call past its settling window (the ranks still inside wait in a collective the failed ranks will never
        join) or past its deadline (stuck: nothing can interrupt a call inside a rank); None while it may complete."""
        now = time.monotonic()
        pending = self.pending
        if self.settle_end is not None and now >= self.settle_end:
            return self._blocked(pending)
        if self.deadline is not None and now >= self.deadline:
            ranks = ", ".join(f"rank {r}" for r in pending)
            return Overdue(
                f"{self.what} timed out after {self.timeout:g} s (no answer from {ranks})",
                TimeoutError(
                    f"{self.what} timed out after {self.timeout:g} s: no answer from {ranks}. A call cannot be "
                    f"interrupted inside a rank's {self.unit}, so every {self.unit} was torn down (a later call would "
                    "wait behind this one); create a new VideoGenerator to continue."
                ),
            )
        return None

    def _blocked(self, pending: Sequence[int]) -> Overdue:
        answered = list(self.statuses.values())
        error = collective_error(self.method, answered)
        assert error is not None  # settling starts at a failure
        failures: dict[int, tuple[str, str]] = getattr(error, "failures", {})
        failed = ", ".join(str(r) for r in sorted(failures))
        blocked = ", ".join(str(r) for r in sorted(pending))
        return Overdue(
            f"rank(s) {failed} failed while rank(s) {blocked} waited in a collective with them",
            RankFailure(
                f"{error}\nrank(s) {blocked} were still inside the call {SETTLE_S:.0f} s later, blocked in a "
                f"collective the failed rank(s) will never join; every {self.unit} was torn down and this "
                "VideoGenerator can no longer be used: create a new one.",
                failures,
            ),
            remote_traceback(s for s in answered if not s.ok),
        )

    def result(self, unique_reply_rank: int | None) -> Any:
        """Every rank's result in rank order (or one rank's); the one collective error if any rank failed."""
        statuses = [self.statuses[rank] for rank in range(self.world_size)]
        error = collective_error(self.method, statuses)
        if error is not None:
            raise error from remote_traceback(s for s in statuses if not s.ok)
        if unique_reply_rank is not None:
            return statuses[unique_reply_rank].result
        return [s.result for s in statuses]


class RemoteRanksExecutor(Executor):
    """An executor whose ranks live in other processes (mp's workers, Ray's actors): whether it is closed, why it is
    dead once its ranks are gone, a death its monitor saw while idle, and the health check that reads them."""

    kind: ClassVar[str]  # as messages name the executor: "mp", "ray"

    def __init__(self) -> None:
        super().__init__()
        self._closed = False
        self._dead: str | None = None  # why the ranks are gone, once they are
        self._died_idle: WorkerDiedError | None = None  # a death the monitor saw: what the next call raises

    def _dead_text(self) -> str:
        return (
            f"the {self.kind} executor is dead: {self._dead}. Create a new VideoGenerator (from_pretrained) to "
            "continue."
        )

    def check_health(self) -> None:
        """Raise what the next call would raise once the ranks are gone; reads state only, never waits on a call in
        flight (a death during a call is that call's to report)."""
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        died_idle = self._died_idle
        if died_idle is not None:
            raise WorkerDiedError(str(died_idle))
        if self._dead is not None:
            raise RuntimeError(self._dead_text())
