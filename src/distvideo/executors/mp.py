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
began stuck, handled as a timeout (the call's answers, its deadline and settling are tracker.py's, shared with Ray).
With `unique_reply_rank=r` only rank r emits and sends its result.

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
import weakref
from multiprocessing.connection import wait
from multiprocessing.shared_memory import SharedMemory
from typing import Any, NoReturn

import cloudpickle

from distvideo.engine import ResolvedEngine
from distvideo.errors import WorkerDiedError
from distvideo.executors.base import (
    SHUT_DOWN,
    Call,
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
    segment_buffer,
)
from distvideo.executors.tracker import CallTracker, RemoteRanksExecutor, call_timeout

logger = logging.getLogger(__name__)

MONITOR_JOIN_S = 5.0  # shutdown: how long the monitor thread gets to see the workers end and leave


#: how a worker's death between two calls is reported ("rank 1 died (killed by SIGKILL) between calls; ...")
IDLE = "between calls"


# --- the driver ---------------------------------------------------------------------------------


class MultiprocExecutor(RemoteRanksExecutor):
    """`num_gpus` spawned worker processes, one rank each; this process (the driver) holds the output."""

    kind = "mp"

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
    def _dispatch(self, call: Call) -> Any:
        method, options = call.method, call.options
        wire = WireCall(
            method,
            call.args,
            call.kwargs,
            events=options.on_event is not None,
            stoppable=options.stop is not None,
            unique_reply_rank=call.unique_reply_rank,
        )
        payload = cloudpickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL) if callable(method) else dumps(wire)
        tracker = CallTracker(method, self.world_size, call_timeout(call.timeout, options), options)
        with self._lock:
            self._check_usable()
            self._next_id += 1
            call_id = self._next_id
            if options.stop is not None:
                options.stop.on_set(lambda: self._cancel(call_id))
            try:
                self._send(call_id, payload)
                self._gather(call_id, tracker)
            except KeyboardInterrupt:
                self._dead = f"interrupted (KeyboardInterrupt) during {tracker.what}"
                logger.info("interrupted: tearing the %d workers down", self.world_size)
                self._stop_workers(graceful=False)
                raise
            finally:
                self._free_segments()
        return tracker.result(call.unique_reply_rank)

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

    def _gather(self, call_id: int, tracker: CallTracker) -> None:
        """Every rank's answer to call `call_id` into `tracker` (notes go to the call's `on_event` as they arrive).
        A call the tracker finds overdue (a lockstep failure past its settling time, or past the timeout: the ranks
        are stuck inside it, and nothing can interrupt them) tears every worker down rather than leave the next call
        queued behind it."""
        on_event = tracker.options.on_event
        while tracker.pending:
            overdue = tracker.overdue()
            if overdue is not None:
                self._dead = overdue.dead
                logger.error("%s: tearing the %d workers down", overdue.dead, self.world_size)
                self._stop_workers(graceful=False)
                raise overdue.error from overdue.cause
            # like multiprocessing.connection.wait on pipes and sentinels, without a new selector per call
            events = self._workers.poller.poll(math.ceil(tracker.wait_s(WAIT_SLICE_S) * 1000))
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
                    if answer_id == call_id and on_event is not None:
                        on_event(status.value)
                    continue
                self._answered[rank] = answer_id
                if answer_id == call_id:  # else the late answer to a timed-out call
                    tracker.answer(rank, status)
            if died:
                self._worker_died(min(died), tracker.what)

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
