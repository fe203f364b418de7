"""The mp executor: distvideo spawns one worker process per rank on this machine and drives them.

Control plane: one duplex pipe per worker (the message format is in mp_wire.py, the worker's loop in
mp_worker.py). A call is pickled once and written to every pipe with a call id; each rank answers with a
`RankStatus`. Payloads over 64 KiB travel through one shared-memory segment read by every rank, so a write to a pipe
never waits on a busy worker. The driver waits on the pipes *and* the process sentinels, so a dead worker is noticed
at once, also in the middle of a call. The output rank hands frames back through shared memory.

The ranks meet privately: their rendezvous is a file store in a directory only this user can open (no TCP store),
and gloo binds to the loopback interface.

Failures are data: a rank whose call raised answers with its error and the executor stays usable; a
call past its `timeout` raises TimeoutError and its late answers are dropped by call id. A dead worker,
a failed start-up or Ctrl-C tears every worker down. Workers end themselves when the driver dies.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any, NoReturn

import cloudpickle

from distvideo.engine import ResolvedEngine
from distvideo.errors import RankFailure, WorkerDiedError
from distvideo.executors.base import Executor, RankStatus, collective_error, method_name
from distvideo.executors.mp_procs import WorkerProcesses
from distvideo.executors.mp_wire import (
    HEADER,
    IN_SHM,
    INLINE_PAYLOAD_MAX,
    OP_BATCH,
    OP_CALL,
    OP_FORWARD,
    STARTUP_ID,
    ItemNote,
    ProgressNote,
    describe_exit,
    discard,
    dumps,
    exit_hint,
    remote_traceback,
    segment_buffer,
    take_frames,
)
from distvideo.request import GenerationRequest

if TYPE_CHECKING:
    from distvideo.executors.mp_wire import SharedFrames
    from distvideo.outputs import ItemOutcome, WorkerOutput

logger = logging.getLogger(__name__)

#: execute_forward failed on some rank while others are still inside it: how long they get to answer before the
#: driver concludes they are blocked in a collective the failed rank will never join (as SETTLE_S of external.py)
FORWARD_FAILURE_SETTLE_S = 5.0
#: The longest the driver blocks in one wait. A Ctrl-C that the kernel delivers to another thread of the driver
#: (torch's OpenMP threads, for one) does not interrupt the main thread's poll; waking at least this often lets the
#: main thread run the pending handler and raise KeyboardInterrupt.
WAIT_SLICE_S = 0.5
#: A request past its request_timeout stops at the next denoising step by itself; a forward that has not answered
#: STOP_GRACE_FACTOR x request_timeout + STOP_GRACE_S after it started is stuck (a long decode, a hung rank).
STOP_GRACE_FACTOR = 2.0
STOP_GRACE_S = 30.0


# --- the driver ---------------------------------------------------------------------------------


class MultiprocExecutor(Executor):
    """`num_gpus` spawned worker processes, one rank each; this process (the driver) holds the output."""

    def __init__(self, engine: ResolvedEngine):
        self.engine = engine
        self.world_size = n = engine.world_size
        self._workers = WorkerProcesses(engine)
        self._procs, self._conns = self._workers.procs, self._workers.conns  # filled as the workers start
        self._lock = threading.Lock()
        self._next_id = STARTUP_ID
        self._answered = [STARTUP_ID] * n  # per rank, the last call id it answered (calls run in order)
        self._segments: dict[int, SharedMemory] = {}  # call id -> payload segment not yet read by every rank
        self._dead: str | None = None  # why the workers are gone, once they are
        self._forward_id: int | None = None  # the execute_forward call running now (what cancel() stops)
        self._closed = False
        _LIVE.add(self)
        try:
            self._workers.spawn()
            self._workers.await_startup()
        except BaseException as exc:
            self._dead = self._dead or f"start-up failed ({type(exc).__name__})"
            self._closed = True
            self._stop_workers(graceful=False)
            _LIVE.discard(self)
            raise

    @property
    def is_output_rank(self) -> bool:
        return True

    # -- calls -----------------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        message = (method, tuple(args), dict(kwargs or {}))
        payload = cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL) if callable(method) else dumps(message)
        statuses = self._call(OP_CALL, payload, method, timeout)
        return [s.result for s in statuses]

    def execute_forward(
        self, request: GenerationRequest, on_progress: Callable[[int, int], None] | None = None
    ) -> WorkerOutput:
        """Every rank runs the request; only the output rank's frames come back, through shared memory. The ranks
        stop by themselves at a step boundary past request_timeout; one that still has not answered
        STOP_GRACE_FACTOR x request_timeout + STOP_GRACE_S later is stuck, and every worker is torn down."""
        limit = None
        if request.request_timeout is not None:
            limit = STOP_GRACE_FACTOR * request.request_timeout + STOP_GRACE_S
        statuses = self._call(OP_FORWARD, dumps(request), "execute_forward", limit, on_progress)
        for status in statuses:
            if status.rank != self.output_rank:
                discard(status)  # other ranks send no frames; a guard, not a path
        output: WorkerOutput
        shared: SharedFrames | None
        output, shared = statuses[self.output_rank].result
        frames = take_frames(shared) if shared is not None else None
        return dataclasses.replace(output, frames=frames)

    def execute_batch(
        self, shares: list[list[tuple[int, GenerationRequest]]], on_item: Callable[[ItemOutcome], None]
    ) -> None:
        """Every worker runs its replica's share; the driver receives each item (frames through shared memory) as its
        replica's output rank finishes it, and calls `on_item` here."""
        self._call(OP_BATCH, dumps(shares), "execute_batch", None, on_item=on_item)

    def cancel(self) -> None:
        call_id = self._forward_id
        if call_id is not None:
            self._workers.control.cancel(call_id)

    def _call(
        self,
        op: int,
        payload: bytes,
        method: str | Callable[..., Any],
        timeout: float | None,
        on_progress: Callable[[int, int], None] | None = None,
        on_item: Callable[[ItemOutcome], None] | None = None,
    ) -> list[RankStatus]:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"collective_rpc: timeout={timeout} must be a positive number of seconds, or None")
        with self._lock:
            self._check_usable()
            self._next_id += 1
            call_id = self._next_id
            self._forward_id = call_id if op in (OP_FORWARD, OP_BATCH) else None
            try:
                self._send(call_id, op, payload)
                settle = op in (OP_FORWARD, OP_BATCH)
                statuses = self._gather(
                    call_id, method, timeout, settle=settle, on_progress=on_progress, on_item=on_item
                )
            except KeyboardInterrupt:
                self._dead = f"interrupted (KeyboardInterrupt) during collective_rpc({method_name(method)!r})"
                logger.info("interrupted: tearing the %d workers down", self.world_size)
                self._stop_workers(graceful=False)
                raise
            finally:
                self._forward_id = None
                self._free_segments()
        error = collective_error(method, statuses)
        if error is not None:
            for status in statuses:
                discard(status)
            raise error from remote_traceback(s for s in statuses if not s.ok)
        return statuses

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the executor is shut down; create a new VideoGenerator")
        if self._dead is not None:
            raise RuntimeError(
                f"the mp executor is dead: {self._dead}. Create a new VideoGenerator (from_pretrained) to continue."
            )
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is not None:
                self._worker_died(rank, "between calls")

    def _send(self, call_id: int, op: int, payload: bytes) -> None:
        if len(payload) > INLINE_PAYLOAD_MAX:
            segment = SharedMemory(create=True, size=len(payload))
            segment_buffer(segment)[: len(payload)] = payload
            self._segments[call_id] = segment
            message = HEADER.pack(call_id, op | IN_SHM) + pickle.dumps((segment.name, len(payload)))
        else:
            message = HEADER.pack(call_id, op) + payload
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:  # the worker is gone; its sentinel tells how
                self._worker_died(rank, f"call {call_id}")

    def _gather(
        self,
        call_id: int,
        method: str | Callable[..., Any],
        timeout: float | None,
        *,
        settle: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
        on_item: Callable[[ItemOutcome], None] | None = None,
    ) -> list[RankStatus]:
        """Every rank's status of call `call_id` (progress notes go to `on_progress` as they arrive). `settle`
        (execute_forward, whose ranks run in lockstep): once a rank has failed, the others get
        FORWARD_FAILURE_SETTLE_S to answer; then they are taken to be blocked in a collective with it, and every
        worker is torn down (see `_blocked_after_failure`). Past `timeout` the ranks are stuck in the call: nothing
        can interrupt it, so every worker is torn down rather than leave the next call queued behind it."""
        statuses: list[RankStatus | None] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = None if timeout is None else time.monotonic() + timeout
        settle_end: float | None = None
        what = f"collective_rpc({method_name(method)!r})"
        while pending:
            now = time.monotonic()
            if settle_end is not None and now >= settle_end:
                self._blocked_after_failure(method, [s for s in statuses if s is not None], pending)
            remaining = None if deadline is None else deadline - now
            if remaining is not None and remaining <= 0:
                ranks = ", ".join(f"rank {r}" for r in sorted(pending))
                self._dead = f"{what} timed out after {timeout:g} s (no answer from {ranks})"
                logger.error("%s: tearing the %d workers down", self._dead, self.world_size)
                self._stop_workers(graceful=False)
                raise TimeoutError(
                    f"{what} timed out after {timeout:g} s: no answer from {ranks}. A call cannot be interrupted "
                    "inside a worker, so every worker was torn down (a later call would wait behind this one); "
                    "create a new VideoGenerator to continue."
                )
            if settle_end is not None:
                remaining = settle_end - now if remaining is None else min(remaining, settle_end - now)
            # like multiprocessing.connection.wait on pipes and sentinels, without a new selector per call
            wait_s = WAIT_SLICE_S if remaining is None else min(remaining, WAIT_SLICE_S)
            events = self._workers.poller.poll(math.ceil(wait_s * 1000))
            died = []
            for fd, _ in events:  # answers first: a worker may answer and then exit
                is_pipe, rank = self._workers.fd_owner[fd]
                try:
                    if not is_pipe:
                        raise EOFError
                    answer_id, status = pickle.loads(self._conns[rank].recv_bytes())
                except (EOFError, OSError):
                    died.append(rank)
                    continue
                if isinstance(status, ProgressNote):
                    if answer_id == call_id and on_progress is not None:
                        on_progress(status.done, status.total)
                    continue
                if isinstance(status, ItemNote):
                    self._deliver_item(status, on_item if answer_id == call_id else None)
                    continue
                self._answered[rank] = answer_id
                if answer_id == call_id:
                    statuses[rank] = status
                    pending.discard(rank)
                    if settle and not status.ok and settle_end is None:
                        settle_end = time.monotonic() + FORWARD_FAILURE_SETTLE_S
                else:
                    discard(status)  # the late answer to a timed-out call
            if died:
                self._worker_died(min(died), what)
        return [s for s in statuses if s is not None]

    @staticmethod
    def _deliver_item(note: ItemNote, on_item: Callable[[ItemOutcome], None] | None) -> None:
        frames = take_frames(note.frames) if note.frames is not None else None
        outcome = note.outcome
        if outcome.output is not None:
            outcome = dataclasses.replace(outcome, output=dataclasses.replace(outcome.output, frames=frames))
        if on_item is not None:
            on_item(outcome)

    def _blocked_after_failure(
        self, method: str | Callable[..., Any], answered: list[RankStatus], pending: set[int]
    ) -> NoReturn:
        """Some ranks failed a lockstep call and the others did not answer within the settling time: they wait in a
        collective that will never complete. Tear every worker down (the group cannot be trusted any more) and raise
        the failed ranks' error, saying which ranks were left blocked."""
        error = collective_error(method, answered)
        assert error is not None
        for status in answered:
            discard(status)
        blocked = ", ".join(str(r) for r in sorted(pending))
        failures: dict[int, tuple[str, str]] = getattr(error, "failures", {})
        failed = ", ".join(str(r) for r in sorted(failures))
        self._dead = f"rank(s) {failed} failed while rank(s) {blocked} waited in a collective with them"
        logger.error(
            "%s for %.0f s: tearing the %d workers down", self._dead, FORWARD_FAILURE_SETTLE_S, self.world_size
        )
        self._stop_workers(graceful=False)
        raise RankFailure(
            f"{error}\nrank(s) {blocked} were still inside the call {FORWARD_FAILURE_SETTLE_S:.0f} s later, blocked in "
            "a collective the failed rank(s) will never join; every worker was torn down and this VideoGenerator can "
            "no longer be used: create a new one.",
            failures,
        ) from remote_traceback(s for s in answered if not s.ok)

    def _worker_died(self, rank: int, during: str) -> NoReturn:
        """Record why the executor is dead, tear every worker down and raise."""
        proc = self._procs[rank]
        proc.join(1.0)
        if self._closed:
            raise RuntimeError(f"the executor was shut down during {during}")
        died = [f"rank {rank} died ({describe_exit(proc.exitcode)})"]
        died += [
            f"rank {r} died ({describe_exit(p.exitcode)})"
            for r, p in enumerate(self._procs)
            if r != rank and p.exitcode is not None
        ]
        self._dead = f"{', '.join(died)} during {during}"
        self._stop_workers(graceful=False)
        raise WorkerDiedError(
            f"{self._dead}; the other workers were torn down and this VideoGenerator can no longer be used: "
            "create a new one." + exit_hint(proc.exitcode)
        )

    def _free_segments(self) -> None:
        """Unlink payload segments every rank has read (it answered that call or a later one)."""
        if not self._segments:
            return
        done = min(self._answered) if self._dead is None else max(self._segments)
        for call_id in [c for c in self._segments if c <= done]:
            segment = self._segments.pop(call_id)
            segment.close()
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()

    # -- shutdown --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_workers(graceful=self._dead is None)
        _LIVE.discard(self)

    def _stop_workers(self, graceful: bool) -> None:
        self._workers.stop(graceful)
        self._dead = self._dead or "shut down"
        self._free_segments()


# Executors still running at interpreter exit: stopped before multiprocessing's own exit hook, which
# would otherwise wait forever on the (non-daemonic) workers.
_LIVE: weakref.WeakSet[MultiprocExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    for executor in list(_LIVE):
        executor.shutdown()
