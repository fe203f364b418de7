"""The executor contract: `collective_rpc` reaches every rank and returns results in rank order.

Everything else (generation, LoRA, health checks) is expressed through it. A failure on any rank
is data, not a signal: each rank reports a status, and the caller raises one RuntimeError naming
every failed rank, in the same words on every executor.
"""

from __future__ import annotations

import abc
import dataclasses
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distvideo.config import GenerationRequest
from distvideo.errors import RankFailure


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


def collective_error(method: str | Callable[..., Any], statuses: Sequence[RankStatus]) -> RankFailure | None:
    """The one error for a call that failed somewhere, or None if every rank succeeded."""
    failed = [s for s in statuses if not s.ok]
    if not failed:
        return None
    lines = [f"collective_rpc({method_name(method)!r}) failed on {len(failed)} of {len(statuses)} rank(s):"]
    for s in sorted(failed, key=lambda s: s.rank):
        lines.append(f"  rank {s.rank}: {s.error_type}: {s.error_message}")
    return RankFailure("\n".join(lines), {s.rank: (s.error_type, s.error_message) for s in failed})


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

    def execute_forward(self, request: GenerationRequest) -> Any:
        """Run one request on every rank; return the output rank's WorkerOutput (others: their own)."""
        results = self.collective_rpc("execute_forward", args=(request,))
        return results[self.output_rank] if self.is_output_rank else results[0]

    def ensure_consistent(self, what: str, fields: dict[str, Any]) -> None:
        """Refuse a call whose arguments differ between ranks. One driver sends the same call to every
        rank on inline and mp, so only external launchers (every process calls by itself) can diverge."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every rank; idempotent."""
