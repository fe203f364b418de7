"""The executor contract: one primitive, `collective_rpc`, reaches every rank and returns results in rank order.

An executor implements only how its ranks start, `collective_rpc` and `shutdown`. Everything else is written once,
here, on top of it: generation (`execute_forward`), batches (`execute_batch`), cancellation (`cancel`) and the health
check; LoRA (lora/control.py) calls `collective_rpc` itself. What those need of a call beyond reaching every rank
(events while it runs, being stopped from another thread, lockstep failure handling, a call that limits itself in
time) are the `CallOptions` of the primitive, so no executor has an operation of its own for them.

A failure on any rank is data, not a signal: each rank reports a status, and the caller raises one RuntimeError
naming every failed rank, in the same words on every executor.
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
from distvideo.request import ResolvedRequest

if TYPE_CHECKING:
    from distvideo.executors.store import StoreAddress
    from distvideo.outputs import ItemOutcome, WorkerOutput

#: what every call on a shut-down executor or generator raises (as a RuntimeError)
SHUT_DOWN = "this VideoGenerator is shut down; create a new one with VideoGenerator.from_pretrained()"
#: a lockstep call failed on some rank while others are still inside it: how long they get to answer before they are
#: taken to be blocked in a collective the failed rank will never join (mp tears its workers down; under a launcher the
#: failed rank leaves the process group, which fails their collectives at once)
SETTLE_S = 5.0


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
#: failures the ranks of a lockstep call decide together (a stop at a step, a refusal all ranks agreed on): nobody is
#: left waiting for the failed rank, so there is nothing to settle
_TOGETHER = {*_STOPS, "ConfigError"}


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


def must_settle(status: RankStatus) -> bool:
    """Whether a rank's answer to a lockstep call may leave the other ranks waiting for it (the settling rule)."""
    return not status.ok and status.error_type not in _TOGETHER


class StopToken:
    """Set by `Executor.cancel()` while its call runs. The ranks read it between denoising steps through the
    `cancelled` function the worker method receives; an executor whose ranks live elsewhere (mp) forwards the set to
    them with `on_set`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._listeners: list[Callable[[], None]] = []

    def set(self) -> None:
        with self._lock:
            self._set = True
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()

    def is_set(self) -> bool:
        return self._set

    def on_set(self, listener: Callable[[], None]) -> None:
        """Call `listener` once the token is set (at once if it is already)."""
        with self._lock:
            if not self._set:
                self._listeners.append(listener)
                return
        listener()


@dataclass(frozen=True)
class CallOptions:
    """What a call may ask of `collective_rpc` beyond reaching every rank; every option is off by default.

    - `on_event`: the worker method receives `emit`, a function taking one picklable value; `on_event(value)` is
      called with it in the process that holds that rank's results (the driver on inline and mp, the rank's own
      process under a launcher), during the call. With `unique_reply_rank=r` only rank r's events reach the driver
      (inline, mp); under a launcher each process gets its own rank's.
    - `stop`: the worker method receives `cancelled`, a function that says whether `stop` was set (the ranks check it
      together between steps, so they stop at the same one).
    - `lockstep`: the ranks run in lockstep (collectives inside the call). Once a rank failed on its own
      (`must_settle`), the others get SETTLE_S to answer; still inside, they are blocked waiting for it, and the
      executor releases them (mp: tears the workers down; under a launcher the failed rank leaves the group).
    - `self_limit`: seconds after which the call's ranks stop by themselves (a request's request_timeout). An
      executor that can watch its ranks (mp) takes a call still unanswered long past it as stuck, like a timeout.
    - `label`: how heartbeats and broken-group reports name the call (default ``collective_rpc('<method>')``).
    """

    on_event: Callable[[Any], None] | None = None
    stop: StopToken | None = None
    lockstep: bool = False
    self_limit: float | None = None
    label: str | None = None


PLAIN = CallOptions()


@dataclass(frozen=True)
class Call:
    """One `collective_rpc`, its arguments checked (Executor.collective_rpc)."""

    method: str | Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float | None
    unique_reply_rank: int | None
    options: CallOptions


def call_hooks(
    kwargs: dict[str, Any] | None, emit: Callable[[Any], None] | None, cancelled: Callable[[], bool] | None
) -> dict[str, Any]:
    """The keyword arguments a worker method gets: the caller's, plus `emit` and `cancelled` when the call has them."""
    out = dict(kwargs or {})
    if emit is not None:
        out["emit"] = emit
    if cancelled is not None:
        out["cancelled"] = cancelled
    return out


def local_hooks(kwargs: dict[str, Any] | None, options: CallOptions) -> dict[str, Any]:
    """`call_hooks` for a rank that runs in the caller's process (inline, external)."""
    stop = options.stop
    return call_hooks(kwargs, options.on_event, stop.is_set if stop is not None else None)


def check_reply_rank(world_size: int, unique_reply_rank: int | None) -> None:
    if unique_reply_rank is not None and not 0 <= unique_reply_rank < world_size:
        raise ValueError(
            f"collective_rpc: unique_reply_rank={unique_reply_rank} is not a rank of this executor "
            f"(ranks 0..{world_size - 1}), or None for every rank's result"
        )


def run_guarded(rank: int, fn: Callable[[], Any]) -> RankStatus:
    try:
        return RankStatus(rank=rank, ok=True, result=fn())
    except Exception as exc:
        return RankStatus.from_exception(rank, exc)


class Executor(abc.ABC):
    """How ranks exist and how a call reaches all of them. A subclass starts its ranks in `__init__` (calling
    `super().__init__()` first) and implements `_dispatch` (how `collective_rpc` reaches its ranks) and `shutdown`;
    the rest is written here."""

    world_size: int = 1
    output_rank: int = 0

    def __init__(self) -> None:
        self._stop_lock = threading.Lock()
        self._running_stop: StopToken | None = None

    @property
    @abc.abstractmethod
    def is_output_rank(self) -> bool:
        """Whether this process holds the output rank's results (frames, the written video)."""

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        *,
        options: CallOptions = PLAIN,
    ) -> Any:
        """Run `method` on every rank's worker; one RankFailure if any rank failed. Returns every rank's result in
        rank order, or with `unique_reply_rank=r` rank r's result alone (the other ranks' results are not sent; under
        a launcher, where every process is one rank, each process returns its own rank's result). `timeout`: seconds
        the driver waits before the ranks count as stuck (torn down); None waits as long as the call takes."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"collective_rpc: timeout={timeout} must be a positive number of seconds, or None")
        check_reply_rank(self.world_size, unique_reply_rank)
        return self._dispatch(Call(method, tuple(args), dict(kwargs or {}), timeout, unique_reply_rank, options))

    @abc.abstractmethod
    def _dispatch(self, call: Call) -> Any:
        """`collective_rpc` once its arguments are checked: what this executor does to reach its ranks."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every rank; idempotent."""

    def ensure_consistent(self, what: str, fields: dict[str, Any]) -> None:
        """Refuse a call whose arguments differ between ranks. One driver sends the same call to every
        rank on inline and mp, so only external launchers (every process calls by itself) can diverge."""
        return None

    def rendezvous_store(self) -> StoreAddress | None:
        """The TCPStore this process can reach and every rank already uses to meet, where the executor's ranks meet
        through one it made (Ray over several nodes: rank 0's); None where they meet otherwise (a private file store,
        a launcher's store: the service finds that one itself). The service's replicas exchange jobs there."""
        return None

    def check_health(self) -> None:
        """Raise the error the next call would raise if the ranks can no longer run calls, without making a call
        (mp: a worker that died while the executor was idle). Cheap; safe from any thread."""
        return None

    # -- written once, on top of collective_rpc -------------------------------------------------------------------
    def execute_forward(
        self, request: ResolvedRequest, on_progress: Callable[[int, int], None] | None = None
    ) -> WorkerOutput:
        """Run one request on every rank; return the output rank's WorkerOutput (under a launcher each rank its own,
        without frames off the output rank). `on_progress(done, total)` is called in this process after every
        denoising step (the output rank's steps; under a launcher this rank's)."""
        on_event = None if on_progress is None else _progress_events(on_progress)
        with self._stoppable() as stop:
            options = CallOptions(
                on_event=on_event,
                stop=stop,
                lockstep=True,
                self_limit=request.request_timeout,
                label="execute_forward",
            )
            output: WorkerOutput = self.collective_rpc(
                "execute_forward", args=(request,), unique_reply_rank=self.output_rank, options=options
            )
        return output

    def execute_batch(
        self, shares: list[list[tuple[int, ResolvedRequest]]], on_item: Callable[[ItemOutcome], None]
    ) -> None:
        """Every replica runs its share (replica k: `shares[k]`, (index, request) pairs, in order); replicas do not
        wait on each other until the end. `on_item(ItemOutcome)` is called after every item, in the process that holds
        its frames: this one (inline, mp), or the replica's output rank (under a launcher)."""
        with self._stoppable() as stop:
            options = CallOptions(on_event=on_item, stop=stop, lockstep=True, label="execute_batch")
            self.collective_rpc("execute_batch", args=(shares,), options=options)

    def cancel(self) -> None:
        """Stop the running request (if any) at its next denoising step on every rank: it raises
        GenerationCancelled and the executor stays usable. Safe to call from any thread; a no-op between requests."""
        with self._stop_lock:
            stop = self._running_stop
        if stop is not None:
            stop.set()

    @contextlib.contextmanager
    def _stoppable(self) -> Iterator[StopToken]:
        """A fresh token for the request about to run: `cancel()` stops that one and never the next."""
        stop = StopToken()
        with self._stop_lock:
            self._running_stop = stop
        try:
            yield stop
        finally:
            with self._stop_lock:
                self._running_stop = None


def _progress_events(on_progress: Callable[[int, int], None]) -> Callable[[Any], None]:
    """The event sink of a forward: the worker emits (done, total) after every denoising step."""

    def on_event(note: Any) -> None:
        done, total = note
        on_progress(done, total)

    return on_event
