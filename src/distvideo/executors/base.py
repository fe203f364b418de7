"""The executor contract: `collective_rpc` reaches every rank and returns results in rank order.

Everything else (generation, LoRA, health checks) is expressed through it. A failure on any rank
is data, not a signal: each rank reports a status, and the caller raises one RuntimeError naming
every failed rank, in the same words on every executor.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distvideo.errors import GenerationCancelled, GenerationTimeout, RankFailure
from distvideo.request import GenerationRequest

if TYPE_CHECKING:
    from distvideo.outputs import ItemOutcome, WorkerOutput


@dataclass
class RankStatus:
    rank: int
    ok: bool
    result: Any = None
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    exception: BaseException | None = field(default=None, repr=False, compare=False)  # local only, never sent

    def for_transport(self) -> RankStatus:
        """A copy safe to pickle to another process (the exception object may not be)."""
        return dataclasses.replace(self, exception=None)

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankStatus:
        return cls(
            rank=rank,
            ok=False,
            error_type=type(exc).__name__,
            error_message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            exception=exc,
        )


def method_name(method: str | Callable[..., Any]) -> str:
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))


#: errors every rank raises together by design (a request stopped between two steps): re-raised as themselves
_STOPS: dict[str, type[GenerationCancelled]] = {
    "GenerationTimeout": GenerationTimeout,
    "GenerationCancelled": GenerationCancelled,
}


def collective_error(method: str | Callable[..., Any], statuses: Sequence[RankStatus]) -> RuntimeError | None:
    """The one error for a call that failed somewhere, or None if every rank succeeded. A request every failed rank
    stopped on purpose (cancelled, past its deadline) raises that error itself, not a RankFailure."""
    failed = [s for s in statuses if not s.ok]
    if not failed:
        return None
    if all(s.error_type in _STOPS for s in failed):
        kind = (
            "GenerationTimeout" if any(s.error_type == "GenerationTimeout" for s in failed) else "GenerationCancelled"
        )
        first = min((s for s in failed if s.error_type == kind), key=lambda s: s.rank)
        return _STOPS[kind](first.error_message)
    lines = [f"collective_rpc({method_name(method)!r}) failed on {len(failed)} of {len(statuses)} rank(s):"]
    for s in sorted(failed, key=lambda s: s.rank):
        lines.append(f"  rank {s.rank}: {s.error_type}: {s.error_message}")
    return RankFailure("\n".join(lines), {s.rank: (s.error_type, s.error_message) for s in failed})


class RequestIds:
    """Which request is running in this process, so that `cancel()` stops that one and never the next: each request
    gets a number, and its `cancelled()` test compares it with the number `cancel()` recorded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._running: int | None = None
        self._cancelled: int | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[Callable[[], bool]]:
        with self._lock:
            self._next += 1
            current = self._running = self._next
        try:
            yield lambda: self._cancelled == current
        finally:
            with self._lock:
                self._running = None

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = self._running

    @property
    def current(self) -> int | None:
        return self._running


def run_guarded(rank: int, fn: Callable[[], Any]) -> RankStatus:
    try:
        return RankStatus(rank=rank, ok=True, result=fn())
    except Exception as exc:
        return RankStatus.from_exception(rank, exc)


class Executor(abc.ABC):
    """How ranks exist and how a call reaches all of them."""

    world_size: int = 1
    output_rank: int = 0

    @property
    @abc.abstractmethod
    def is_output_rank(self) -> bool:
        """Whether this process holds the output rank's results (frames, the written video)."""

    @abc.abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Run `method` on every rank's worker; results in rank order; one RankFailure if any rank failed."""

    @abc.abstractmethod
    def execute_forward(
        self, request: GenerationRequest, on_progress: Callable[[int, int], None] | None = None
    ) -> WorkerOutput:
        """Run one request on every rank; return the output rank's WorkerOutput (others: their own).
        `on_progress(done, total)` is called in this process after every denoising step."""

    @abc.abstractmethod
    def execute_batch(
        self, shares: list[list[tuple[int, GenerationRequest]]], on_item: Callable[[ItemOutcome], None]
    ) -> None:
        """Every replica runs its share (replica k: `shares[k]`, (index, request) pairs, in order); replicas do not
        wait on each other until the end. `on_item(ItemOutcome)` is called after every item, in the process that holds
        its frames: this one (inline, mp), or the replica's output rank (under a launcher)."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop the running request (if any) at its next denoising step on every rank: it raises
        GenerationCancelled and the executor stays usable. Safe to call from any thread; a no-op between requests."""

    def ensure_consistent(self, what: str, fields: dict[str, Any]) -> None:
        """Refuse a call whose arguments differ between ranks. One driver sends the same call to every
        rank on inline and mp, so only external launchers (every process calls by itself) can diverge."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every rank; idempotent."""
