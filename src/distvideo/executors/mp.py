"""The mp executor: distvideo spawns one worker process per rank on this machine and drives them.

Control plane: one duplex pipe per worker (the message format is in mp_wire.py, the worker's loop in
mp_worker.py). A call (one op for every call, `OP_CALL`) is pickled once and written to every pipe with a call id;
each rank answers with a `RankStatus`. Payloads over 64 KiB travel through one shared-memory segment read by every
rank, so a write to a pipe never waits on a busy worker. The driver waits on the pipes *and* the process sentinels, so
a dead worker is noticed at once, also in the middle of a call; between calls a monitor thread waits on the sentinels,
so a worker that dies while the executor is idle is logged at once and the others are torn down then (the next call
raises the WorkerDiedError). Arrays and tensors in answers and events come back through shared memory.

The call options (executors/base.py): events travel as notes before the answer; `stop` is forwarded to the workers
through the control block (a shared word they read between steps); `lockstep` settles for SETTLE_S after a rank failed
alone, then tears down; `self_limit` makes a call unanswered STOP_GRACE_FACTOR x self_limit + STOP_GRACE_S after it
began stuck, handled as a timeout. With `unique_reply_rank=r` only rank r emits and sends its result.

The ranks meet privately: their rendezvous is a file store in a directory only this user can open (no TCP store),
and gloo binds to the loopback interface.

Failures are data: a rank whose call raised answers with its error and the executor stays usable; a
call past its `timeout` raises TimeoutError and its late answers are dropped by call id. A dead worker,
a failed start-up or Ctrl-C tears every worker down. Workers end themselves when the driver dies.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.shared_memory import SharedMemory
from typing import Any, NoReturn

import cloudpickle

from distvideo.engine import ResolvedEngine
from distvideo.errors import RankFailure, WorkerDiedError
from distvideo.executors.base import (
    PLAIN,
    SETTLE_S,
    SHUT_DOWN,
    CallOptions,
    Executor,
    RankStatus,
    check_reply_rank,
    collective_error,
    method_name,
    must_settle,
)
from distvideo.executors.mp_procs import WorkerProcesses
from distvideo.executors.mp_wire import (
    HEADER,
    IN_SHM,
    INLINE_PAYLOAD_MAX,
    OP_CALL,
    STARTUP_ID,
    WAIT_SLICE_S,
    Note,
    WireCall,
    describe_exit,
    dumps,
    exit_hint,
    loads_shared,
    remote_traceback,
    segment_buffer,
)

logger = logging.getLogger(__name__)

#: A call with a self_limit (a request's request_timeout) stops at its next step past it by itself; one that has not
#: answered STOP_GRACE_FACTOR x self_limit + STOP_GRACE_S after it started is stuck (a long decode, a hung rank).
STOP_GRACE_FACTOR = 2.0
STOP_GRACE_S = 30.0
MONITOR_JOIN_S = 5.0  # shutdown: how long the monitor thread gets to see the workers end and leave


#: how a worker's death between two calls is reported ("rank 1 died (killed by SIGKILL) between calls; ...")
IDLE = "between calls"


# --- the driver ---------------------------------------------------------------------------------


class MultiprocExecutor(Executor):
    """`num_gpus` spawned worker processes, one rank each; this process (the driver) holds the output."""

    def __init__(self, engine: ResolvedEngine):
        super().__init__()
        self.engine = engine
        self.world_size = n = engine.world_size
        self._workers = WorkerProcesses(engine)
        self._procs, self._conns = self._workers.procs, self._workers.conns  # filled as the workers start
        self._lock = threading.Lock()  # held by a call, and by the monitor while it handles a death
        self._next_id = STARTUP_ID
        self._answered = [STARTUP_ID] * n  # per rank, the last call id it answered (calls run in order)
        self._segments: dict[int, SharedMemory] = {}  # call id -> payload segment not yet read by every rank
        self._dead: str | None = None  # why the workers are gone, once they are
        self._died_idle: WorkerDiedError | None = None  # a death the monitor saw: what the next call raises
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
        self._monitor_thread = threading.Thread(target=self._monitor, name="distvideo-mp-monitor", daemon=True)
        self._monitor_thread.start()

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
        unique_reply_rank: int | None = None,
        *,
        options: CallOptions = PLAIN,
    ) -> Any:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"collective_rpc: timeout={timeout} must be a positive number of seconds, or None")
        check_reply_rank(self.world_size, unique_reply_rank)
        call = WireCall(
            method,
            tuple(args),
            dict(kwargs or {}),
            events=options.on_event is not None,
            stoppable=options.stop is not None,
            unique_reply_rank=unique_reply_rank,
        )
        payload = cloudpickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL) if callable(method) else dumps(call)
        if options.self_limit is not None:
            stuck = STOP_GRACE_FACTOR * options.self_limit + STOP_GRACE_S
            timeout = stuck if timeout is None else min(timeout, stuck)
        statuses = self._call(payload, method, timeout, options)
        if unique_reply_rank is not None:
            return statuses[unique_reply_rank].result
        return [s.result for s in statuses]

    def check_health(self) -> None:
        """Raise what the next call would raise once the workers are gone; reads state only, never waits on a call
        in flight (a death during a call is that call's to report)."""
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        died_idle = self._died_idle
        if died_idle is not None:
            raise WorkerDiedError(str(died_idle))
        if self._dead is not None:
            raise RuntimeError(self._dead_text())

    def _call(
        self, payload: bytes, method: str | Callable[..., Any], timeout: float | None, options: CallOptions
    ) -> list[RankStatus]:
        with self._lock:
            self._check_usable()
            self._next_id += 1
            call_id = self._next_id
            if options.stop is not None:
                options.stop.on_set(lambda: self._cancel(call_id))
            try:
                self._send(call_id, payload)
                statuses = self._gather(call_id, method, timeout, options)
            except KeyboardInterrupt:
                self._dead = f"interrupted (KeyboardInterrupt) during collective_rpc({method_name(method)!r})"
                logger.info("interrupted: tearing the %d workers down", self.world_size)
                self._stop_workers(graceful=False)
                raise
            finally:
                self._free_segments()
        error = collective_error(method, statuses)
        if error is not None:
            raise error from remote_traceback(s for s in statuses if not s.ok)
        return statuses

    def _cancel(self, call_id: int) -> None:
        """The call's stop token was set: tell the workers (a call that already ended is not stopped again)."""
        if not self._closed and self._dead is None:
            with contextlib.suppress(RuntimeError):  # the control block closed meanwhile: nothing runs any more
                self._workers.control.cancel(call_id)

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        if self._died_idle is not None:  # the monitor saw it: the first call after it reports it as it happened
            died_idle, self._died_idle = self._died_idle, None
            raise died_idle
        if self._dead is not None:
            raise RuntimeError(self._dead_text())
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is not None:  # died just now: the monitor waits for this lock
                self._worker_died(rank, IDLE)

    def _dead_text(self) -> str:
        return f"the mp executor is dead: {self._dead}. Create a new VideoGenerator (from_pretrained) to continue."

    def _send(self, call_id: int, payload: bytes) -> None:
        if len(payload) > INLINE_PAYLOAD_MAX:
            segment = SharedMemory(create=True, size=len(payload))
            segment_buffer(segment)[: len(payload)] = payload
            self._segments[call_id] = segment
            message = HEADER.pack(call_id, OP_CALL | IN_SHM) + pickle.dumps((segment.name, len(payload)))
        else:
            message = HEADER.pack(call_id, OP_CALL) + payload
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:  # the worker is gone; its sentinel tells how
                self._worker_died(rank, f"call {call_id}")

    def _gather(
        self, call_id: int, method: str | Callable[..., Any], timeout: float | None, options: CallOptions
    ) -> list[RankStatus]:
        """Every rank's status of call `call_id` (notes go to `options.on_event` as they arrive). A lockstep call:
        once a rank has failed alone (`must_settle`), the others get SETTLE_S to answer; then they are taken to be
        blocked in a collective with it, and every worker is torn down (see `_blocked_after_failure`). Past `timeout`
        the ranks are stuck in the call: nothing can interrupt it, so every worker is torn down rather than leave the
        next call queued behind it."""
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
                assert timeout is not None
                self._timed_out(what, timeout, pending)
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
                    answer_id, status = loads_shared(self._conns[rank].recv_bytes())
                except (EOFError, OSError):
                    died.append(rank)
                    continue
                if isinstance(status, Note):
                    if answer_id == call_id and options.on_event is not None:
                        options.on_event(status.value)
                    continue
                self._answered[rank] = answer_id
                if answer_id == call_id:  # else the late answer to a timed-out call
                    statuses[rank] = status
                    pending.discard(rank)
                    if options.lockstep and must_settle(status) and settle_end is None:
                        settle_end = time.monotonic() + SETTLE_S
            if died:
                self._worker_died(min(died), what)
        return [s for s in statuses if s is not None]

    def _timed_out(self, what: str, timeout: float, pending: set[int]) -> NoReturn:
        ranks = ", ".join(f"rank {r}" for r in sorted(pending))
        self._dead = f"{what} timed out after {timeout:g} s (no answer from {ranks})"
        logger.error("%s: tearing the %d workers down", self._dead, self.world_size)
        self._stop_workers(graceful=False)
        raise TimeoutError(
            f"{what} timed out after {timeout:g} s: no answer from {ranks}. A call cannot be interrupted "
            "inside a worker, so every worker was torn down (a later call would wait behind this one); "
            "create a new VideoGenerator to continue."
        )

    def _blocked_after_failure(
        self, method: str | Callable[..., Any], answered: list[RankStatus], pending: set[int]
    ) -> NoReturn:
        """Some ranks failed a lockstep call and the others did not answer within the settling time: they wait in a
        collective that will never complete. Tear every worker down (the group cannot be trusted any more) and raise
        the failed ranks' error, saying which ranks were left blocked."""
        error = collective_error(method, answered)
        assert error is not None
        blocked = ", ".join(str(r) for r in sorted(pending))
        failures: dict[int, tuple[str, str]] = getattr(error, "failures", {})
        failed = ", ".join(str(r) for r in sorted(failures))
        self._dead = f"rank(s) {failed} failed while rank(s) {blocked} waited in a collective with them"
        logger.error("%s for %.0f s: tearing the %d workers down", self._dead, SETTLE_S, self.world_size)
        self._stop_workers(graceful=False)
        raise RankFailure(
            f"{error}\nrank(s) {blocked} were still inside the call {SETTLE_S:.0f} s later, blocked in "
            "a collective the failed rank(s) will never join; every worker was torn down and this VideoGenerator can "
            "no longer be used: create a new one.",
            failures,
        ) from remote_traceback(s for s in answered if not s.ok)

    def _worker_died(self, rank: int, during: str) -> NoReturn:
        """Record why the executor is dead, tear every worker down and raise."""
        raise self._death(rank, during)

    def _death(self, rank: int, during: str, *, idle: bool = False) -> RuntimeError:
        """Record that rank `rank` died, tear every worker down; the error to raise. `idle` (the monitor): log it now
        and keep it for the next call (and `check_health`) to raise."""
        proc = self._procs[rank]
        proc.join(1.0)
        when = during if during == IDLE else f"during {during}"
        if self._closed:
            return RuntimeError(f"the executor was shut down {when}")
        died = [f"rank {rank} died ({describe_exit(proc.exitcode)})"]
        died += [
            f"rank {r} died ({describe_exit(p.exitcode)})"
            for r, p in enumerate(self._procs)
            if r != rank and p.exitcode is not None
        ]
        dead = f"{', '.join(died)} {when}"
        error = WorkerDiedError(
            f"{dead}; the other workers were torn down and this VideoGenerator can no longer be used: "
            "create a new one." + exit_hint(proc.exitcode)
        )
        if idle:
            self._died_idle = error
            logger.error("%s", error)
        self._dead = dead
        self._stop_workers(graceful=False)
        return error

    def _monitor(self) -> None:
        """The monitor thread: wait on the workers' sentinels for as long as the executor lives. A death while the
        executor is idle is logged now and tears the other workers down now; the next call raises its error. A call
        in flight holds the lock and handles a death itself (its own poll sees the sentinel), so the monitor waits
        for the call to end and then finds the executor already dead."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        ready = wait(list(sentinels))  # returns once any worker has ended, also at shutdown
        with self._lock:
            if not (self._closed or self._dead is not None):
                self._death(min(sentinels[s] for s in ready if isinstance(s, int)), IDLE, idle=True)

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
        monitor = getattr(self, "_monitor_thread", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(MONITOR_JOIN_S)  # it wakes as the workers end; a call still in flight ends with them

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
