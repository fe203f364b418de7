"""The mp executor: distvideo spawns one worker process per rank on this machine and drives them.

Control plane: one duplex pipe per worker. A call is pickled once and written to every pipe with a call
id; each rank answers with a `RankStatus`. Payloads over 64 KiB travel through one shared-memory
segment read by every rank, so a write to a pipe never waits on a busy worker. The driver waits on the
pipes *and* the process sentinels, so a dead worker is noticed at once, also in the middle of a call.
The output rank hands frames back through shared memory, never as a pickled copy.

Failures are data: a rank whose call raised answers with its error and the executor stays usable; a
call past its `timeout` raises TimeoutError and its late answers are dropped by call id. A dead worker,
a failed start-up or Ctrl-C tears every worker down. Workers end themselves when the driver dies (parent
death signal, a watchdog on the parent pid, end of file on the pipe).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import functools
import logging
import math
import multiprocessing
import multiprocessing.util  # registers its exit hook now, so ours (registered below) runs before it
import os
import pickle
import select
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any, NoReturn

import cloudpickle
import numpy as np

from distvideo.config import EngineConfig, GenerationRequest
from distvideo.executors.base import Executor, RankFailure, RankStatus, collective_error, method_name, run_guarded
from distvideo.models.registry import ModelInfo

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from distvideo.worker import Worker, WorkerOutput

logger = logging.getLogger(__name__)

# Wire format. Driver -> worker: a header (call id, op) followed by the payload. Worker -> driver: a
# pickled (call id, RankStatus). Call id 0 is the start-up report.
_HEADER = struct.Struct("<qB")
_OP_CALL = 1  # payload: pickled (method, args, kwargs)
_OP_FORWARD = 2  # payload: pickled GenerationRequest; the output rank answers with frames in shared memory
_OP_SHUTDOWN = 3
_IN_SHM = 0x80  # flag: the payload is a pickled (segment name, size) of a shared-memory segment
_INLINE_PAYLOAD_MAX = 64 * 1024  # below the pipe's buffer, so a busy worker never blocks the driver
_STARTUP_ID = 0

SHUTDOWN_GRACE_S = 5.0  # shutdown: how long workers get to finish their call and leave by themselves
TERMINATE_GRACE_S = 2.0  # then SIGTERM, then SIGKILL
STARTUP_FAILURE_GRACE_S = 1.5  # after a rank fails to start: how long the others get to report theirs
#: execute_forward failed on some rank while others are still inside it: how long they get to answer before the
#: driver concludes they are blocked in a collective the failed rank will never join (as SETTLE_S of external.py)
FORWARD_FAILURE_SETTLE_S = 5.0
#: The longest the driver blocks in one wait. A Ctrl-C that the kernel delivers to another thread of the driver
#: (torch's OpenMP threads, for one) does not interrupt the main thread's poll; waking at least this often lets the
#: main thread run the pending handler and raise KeyboardInterrupt.
WAIT_SLICE_S = 0.5
PARENT_POLL_S = 0.5


class WorkerDiedError(RuntimeError):
    """A worker process ended during a call (killed, crashed, out of memory); every worker is torn down."""


class RemoteTraceback(Exception):
    """The tracebacks of failed ranks, chained as the cause of the error raised in the driver."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class _SharedFrames:
    """Where the output rank left its frames: a shared-memory segment the driver copies out and unlinks."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def _dumps(obj: Any) -> bytes:
    """pickle, or cloudpickle when pickle cannot (lambdas, functions defined in __main__ or a notebook)."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def describe_exit(exitcode: int | None) -> str:
    """'killed by SIGKILL', 'exit code 3': how a worker process ended, for error messages."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _exit_hint(exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        return " SIGKILL often comes from the kernel's out-of-memory killer (see `dmesg`)."
    if exitcode == -signal.SIGSEGV:
        return " SIGSEGV is a crash in native code (torch, a CUDA driver, an extension)."
    return ""


def _buffer(segment: SharedMemory) -> memoryview:
    buf = segment.buf
    if buf is None:
        raise RuntimeError(f"shared-memory segment {segment.name} is closed")
    return buf


def _unlink_frames(shared: _SharedFrames) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment = SharedMemory(name=shared.name)
        segment.close()
        segment.unlink()


def _take_frames(shared: _SharedFrames) -> np.ndarray:
    """Copy the output rank's frames out of shared memory into an array the driver owns, then unlink."""
    segment = SharedMemory(name=shared.name)
    try:
        view = np.ndarray(shared.shape, dtype=np.dtype(shared.dtype), buffer=_buffer(segment))
        frames = view.copy()
        del view  # the segment cannot close while an array points into it
    finally:
        segment.close()
        segment.unlink()
    return frames


def _discard(status: RankStatus) -> None:
    """Release what an answer nobody will read holds (frames in shared memory)."""
    result = status.result
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], _SharedFrames):
        _unlink_frames(result[1])


# --- the driver ---------------------------------------------------------------------------------


class MultiprocExecutor(Executor):
    """`num_gpus` spawned worker processes, one rank each; this process (the driver) holds the output."""

    def __init__(self, config: EngineConfig, model_info: ModelInfo):
        self.world_size = n = config.num_gpus or 1
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        self._next_id = _STARTUP_ID
        self._answered = [_STARTUP_ID] * n  # per rank, the last call id it answered (calls run in order)
        self._segments: dict[int, SharedMemory] = {}  # call id -> payload segment not yet read by every rank
        self._dead: str | None = None  # why the workers are gone, once they are
        # every pipe and process sentinel, registered once: (is_pipe, rank) by file descriptor
        self._poller = select.poll()
        self._fd_owner: dict[int, tuple[bool, int]] = {}
        self._closed = False
        self._rendezvous_dir: str | None = None
        _LIVE.add(self)
        try:
            self._spawn(config, model_info)
            self._await_startup(config)
        except BaseException as exc:
            self._dead = self._dead or f"start-up failed ({type(exc).__name__})"
            self._closed = True
            self._stop_workers(graceful=False)
            _LIVE.discard(self)
            raise

    @property
    def is_output_rank(self) -> bool:
        return True

    # -- start-up --------------------------------------------------------------------------------
    def _spawn(self, config: EngineConfig, model_info: ModelInfo) -> None:
        ctx = multiprocessing.get_context("spawn")
        # The ranks meet through a file in a private folder (all of them run on this machine): no TCP port is chosen,
        # released and bound again later, which another process could take in between (gloo's own connections bind
        # port 0).
        self._rendezvous_dir = tempfile.mkdtemp(prefix="distvideo-mp-")
        init_method = f"file://{os.path.join(self._rendezvous_dir, 'rendezvous')}"
        # The parent-death signal fires when the spawning *thread* ends; set it only when that is the
        # main thread, which lives as long as the process (the watchdog covers the other case).
        parent_death_signal = threading.current_thread() is threading.main_thread()
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                name=f"distvideo-rank{rank}",
                args=(child_end, config, model_info, rank, self.world_size, init_method),
                kwargs={"parent_pid": os.getpid(), "parent_death_signal": parent_death_signal},
            )
            with _sigint_blocked():
                proc.start()
            child_end.close()  # the driver keeps its end only: a dead worker reads as end of file
            self._procs.append(proc)
            self._conns.append(parent_end)
            for fd, is_pipe in ((parent_end.fileno(), True), (proc.sentinel, False)):
                self._poller.register(fd, select.POLLIN)
                self._fd_owner[fd] = (is_pipe, rank)
        logger.debug("spawned %d workers (%s)", self.world_size, init_method)

    def _await_startup(self, config: EngineConfig) -> None:
        """Wait until every rank reports ready; on the first failure, give the others a moment to report
        theirs (a corrupt file fails every rank), then tear everything down and raise one error."""
        pending = set(range(self.world_size))
        failed: dict[int, RankStatus] = {}
        first_failed: int | None = None
        grace_end: float | None = None
        while pending:
            timeout = WAIT_SLICE_S if grace_end is None else max(0.0, min(WAIT_SLICE_S, grace_end - time.monotonic()))
            waitables: list[Any] = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout)
            if not ready:
                if grace_end is not None and time.monotonic() >= grace_end:
                    break  # the grace period is over
                continue
            for rank in sorted(self._ranks_of(ready) & pending):
                status = self._read_startup(rank)
                if status is None:
                    continue  # a stale byte? keep waiting for this rank
                pending.discard(rank)
                if not status.ok:
                    failed[rank] = status
                    if first_failed is None:
                        first_failed = rank
                        grace_end = time.monotonic() + STARTUP_FAILURE_GRACE_S
        if not failed:
            logger.debug("all %d workers ready", self.world_size)
            return
        assert first_failed is not None
        self._dead = f"start-up failed on rank {first_failed}"
        self._stop_workers(graceful=False)
        lines = [f"the mp executor could not start: {len(failed)} of {self.world_size} rank(s) failed:"]
        for rank in range(self.world_size):
            if rank in failed:
                lines.append(f"  rank {rank}: {failed[rank].error_type}: {failed[rank].error_message}")
            elif rank in pending:
                lines.append(f"  rank {rank}: torn down after rank {first_failed} failed (it was still starting)")
        lines.append(f"model: {config.model}")
        error = RankFailure("\n".join(lines), {r: (s.error_type, s.error_message) for r, s in failed.items()})
        raise error from _remote_traceback(failed.values())

    def _read_startup(self, rank: int) -> RankStatus | None:
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            if conn.poll():
                call_id, status = pickle.loads(conn.recv_bytes())
                return status if call_id == _STARTUP_ID else None
        except (EOFError, OSError):
            pass
        proc.join(1.0)
        if proc.exitcode is None:
            return None
        return RankStatus(
            rank=rank,
            ok=False,
            error_type="WorkerDiedError",
            error_message=(
                f"the worker process died during start-up ({describe_exit(proc.exitcode)}); its traceback, if any, "
                "is on stderr above. A script that creates a VideoGenerator at import time needs "
                "`if __name__ == '__main__':` (spawned workers import the main module)." + _exit_hint(proc.exitcode)
            ),
        )

    def _ranks_of(self, ready: Sequence[object]) -> set[int]:
        ranks = set()
        for obj in ready:
            for rank in range(self.world_size):
                if obj is self._conns[rank] or obj == self._procs[rank].sentinel:
                    ranks.add(rank)
        return ranks

    # -- calls -----------------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        message = (method, tuple(args), dict(kwargs or {}))
        payload = cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL) if callable(method) else _dumps(message)
        statuses = self._call(_OP_CALL, payload, method, timeout)
        return [s.result for s in statuses]

    def execute_forward(self, request: GenerationRequest) -> WorkerOutput:
        """Every rank runs the request; only the output rank's frames come back, through shared memory."""
        statuses = self._call(_OP_FORWARD, _dumps(request), "execute_forward", None)
        for status in statuses:
            if status.rank != self.output_rank:
                _discard(status)  # other ranks send no frames; a guard, not a path
        output, shared = statuses[self.output_rank].result
        frames = _take_frames(shared) if shared is not None else None
        return dataclasses.replace(output, frames=frames)

    def _call(
        self, op: int, payload: bytes, method: str | Callable[..., Any], timeout: float | None
    ) -> list[RankStatus]:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"collective_rpc: timeout={timeout} must be a positive number of seconds, or None")
        with self._lock:
            self._check_usable()
            self._next_id += 1
            call_id = self._next_id
            try:
                self._send(call_id, op, payload)
                statuses = self._gather(call_id, method, timeout, settle=op == _OP_FORWARD)
            except KeyboardInterrupt:
                self._dead = f"interrupted (KeyboardInterrupt) during collective_rpc({method_name(method)!r})"
                logger.info("interrupted: tearing the %d workers down", self.world_size)
                self._stop_workers(graceful=False)
                raise
            finally:
                self._free_segments()
        error = collective_error(method, statuses)
        if error is not None:
            for status in statuses:
                _discard(status)
            raise error from _remote_traceback(s for s in statuses if not s.ok)
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
        if len(payload) > _INLINE_PAYLOAD_MAX:
            segment = SharedMemory(create=True, size=len(payload))
            _buffer(segment)[: len(payload)] = payload
            self._segments[call_id] = segment
            message = _HEADER.pack(call_id, op | _IN_SHM) + pickle.dumps((segment.name, len(payload)))
        else:
            message = _HEADER.pack(call_id, op) + payload
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:  # the worker is gone; its sentinel tells how
                self._worker_died(rank, f"call {call_id}")

    def _gather(
        self, call_id: int, method: str | Callable[..., Any], timeout: float | None, *, settle: bool = False
    ) -> list[RankStatus]:
        """Every rank's status of call `call_id`. `settle` (execute_forward, whose ranks run in lockstep): once a
        rank has failed, the others get FORWARD_FAILURE_SETTLE_S to answer; then they are taken to be blocked in a
        collective with it, and every worker is torn down (see `_blocked_after_failure`)."""
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
                raise TimeoutError(
                    f"{what} timed out after {timeout} s: no answer from {ranks}. The ranks keep running the call "
                    "(the executor stays usable; the next call runs after it, and its late answers are dropped)."
                )
            if settle_end is not None:
                remaining = settle_end - now if remaining is None else min(remaining, settle_end - now)
            # like multiprocessing.connection.wait on pipes and sentinels, without a new selector per call
            wait_s = WAIT_SLICE_S if remaining is None else min(remaining, WAIT_SLICE_S)
            events = self._poller.poll(math.ceil(wait_s * 1000))
            died = []
            for fd, _ in events:  # answers first: a worker may answer and then exit
                is_pipe, rank = self._fd_owner[fd]
                try:
                    if not is_pipe:
                        raise EOFError
                    answer_id, status = pickle.loads(self._conns[rank].recv_bytes())
                except (EOFError, OSError):
                    died.append(rank)
                    continue
                self._answered[rank] = answer_id
                if answer_id == call_id:
                    statuses[rank] = status
                    pending.discard(rank)
                    if settle and not status.ok and settle_end is None:
                        settle_end = time.monotonic() + FORWARD_FAILURE_SETTLE_S
                else:
                    _discard(status)  # the late answer to a timed-out call
            if died:
                self._worker_died(min(died), what)
        return [s for s in statuses if s is not None]

    def _blocked_after_failure(
        self, method: str | Callable[..., Any], answered: list[RankStatus], pending: set[int]
    ) -> NoReturn:
        """Some ranks failed a lockstep call and the others did not answer within the settling time: they wait in a
        collective that will never complete. Tear every worker down (the group cannot be trusted any more) and raise
        the failed ranks' error, saying which ranks were left blocked."""
        error = collective_error(method, answered)
        assert error is not None
        for status in answered:
            _discard(status)
        blocked = ", ".join(str(r) for r in sorted(pending))
        failed = ", ".join(str(r) for r in sorted(error.failures))
        self._dead = f"rank(s) {failed} failed while rank(s) {blocked} waited in a collective with them"
        logger.error(
            "%s for %.0f s: tearing the %d workers down", self._dead, FORWARD_FAILURE_SETTLE_S, self.world_size
        )
        self._stop_workers(graceful=False)
        raise RankFailure(
            f"{error}\nrank(s) {blocked} were still inside the call {FORWARD_FAILURE_SETTLE_S:.0f} s later, blocked in "
            "a collective the failed rank(s) will never join; every worker was torn down and this VideoGenerator can "
            "no longer be used: create a new one.",
            error.failures,
        ) from _remote_traceback(s for s in answered if not s.ok)

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
            "create a new one." + _exit_hint(proc.exitcode)
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
        """Ask the workers to leave, then SIGTERM, then SIGKILL; close the pipes. Safe to call twice."""
        procs = self._procs  # only started processes are listed
        if graceful:
            shutdown = _HEADER.pack(0, _OP_SHUTDOWN)
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(shutdown)
            _join_all(procs, SHUTDOWN_GRACE_S)
        for signame in ("SIGTERM", "SIGKILL"):
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            if graceful or signame == "SIGKILL":
                logger.warning("%d worker(s) did not stop in time; sending %s", len(alive), signame)
            for proc in alive:
                with contextlib.suppress(OSError):
                    proc.terminate() if signame == "SIGTERM" else proc.kill()
            _join_all(alive, TERMINATE_GRACE_S)
        for conn in self._conns:
            conn.close()
        self._dead = self._dead or "shut down"
        self._free_segments()
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Ctrl-C signals the terminal's whole process group; the driver alone decides what it means. A
    worker spawned with SIGINT blocked (the mask survives exec) is not hit even before it ignores it."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a Ctrl-C meanwhile is delivered now


def _join_all(procs: Sequence[BaseProcess], grace: float) -> None:
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def _remote_traceback(statuses: Any) -> RemoteTraceback | None:
    parts = [f"rank {s.rank}:\n{s.traceback.rstrip()}" for s in statuses if s.traceback]
    return RemoteTraceback("\n\n".join(parts)) if parts else None


# Executors still running at interpreter exit: stopped before multiprocessing's own exit hook, which
# would otherwise wait forever on the (non-daemonic) workers.
_LIVE: weakref.WeakSet[MultiprocExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    for executor in list(_LIVE):
        executor.shutdown()


# --- the worker process -------------------------------------------------------------------------


def _set_parent_death_signal(sig: int) -> bool:
    """Linux prctl(PR_SET_PDEATHSIG): the kernel sends `sig` when the parent (thread) ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(1, sig, 0, 0, 0)) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    """Leave when the driver is gone (re-parented), even while the main thread is busy in a call."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(PARENT_POLL_S)


def _detach_stdin() -> None:
    # multiprocessing replaces sys.stdin, but descriptor 0 still points at the driver's terminal
    with contextlib.suppress(OSError):
        fd = os.open(os.devnull, os.O_RDONLY)
        if fd != 0:
            os.dup2(fd, 0)
            os.close(fd)


def _worker_main(
    conn: Connection,
    config: EngineConfig,
    model_info: ModelInfo,
    rank: int,
    world_size: int,
    init_method: str,
    *,
    parent_pid: int,
    parent_death_signal: bool,
) -> None:
    """One spawned rank: start the Worker, report, then serve calls until shutdown or end of file."""
    if parent_death_signal:
        _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the driver died before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="distvideo-parent-watchdog", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the driver decides
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked at spawn; ignored from now on
    _detach_stdin()

    from tqdm import tqdm

    from distvideo.logging_utils import configure_logging, set_log_rank
    from distvideo.worker import RankInfo, Worker

    # tqdm's default lock includes a named POSIX semaphore (for bars shared between processes). A worker that is
    # SIGKILLed cannot unlink it, and the resource tracker then warns about leaked semaphores when the driver exits.
    # A worker's bars are its own: a lock local to the process is enough.
    tqdm.set_lock(threading.RLock())
    set_log_rank(rank)
    configure_logging()
    rank_info = RankInfo(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        init_method=init_method,
        output_rank=0,
    )
    worker: Worker | None = None
    phase = "Worker()"
    try:
        worker = Worker(config, rank_info, model_info=model_info)
        phase = "init_device"
        worker.init_device()
        phase = "load_model"
        worker.load_model()
    except BaseException as exc:
        status = RankStatus.from_exception(rank, exc)
        status.error_message = f"{status.error_message} (in {phase})"
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps((_STARTUP_ID, status.for_transport())))
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.shutdown()
        _leave(1)
    conn.send_bytes(pickle.dumps((_STARTUP_ID, RankStatus(rank=rank, ok=True, result="ready"))))
    try:
        _serve(conn, worker, rank)
    finally:
        worker.shutdown()
        logger.debug("worker stopped")
    _leave(0)


def _leave(code: int) -> NoReturn:
    """Exit without finalising the interpreter: tearing down torch, diffusers and every module takes
    seconds and nothing needs it. What a normal exit runs first still runs: multiprocessing's finalizers
    (they unlink named semaphores, e.g. tqdm's lock) and the atexit handlers (logging flushes)."""
    for cleanup in (getattr(multiprocessing.util, "_exit_function", None), atexit._run_exitfuncs):
        with contextlib.suppress(Exception):
            if cleanup is not None:
                cleanup()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _serve(conn: Connection, worker: Worker, rank: int) -> None:
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            logger.debug("the driver closed the pipe; leaving")
            return
        call_id, op = _HEADER.unpack_from(message)
        if op == _OP_SHUTDOWN:
            return
        payload = memoryview(message)[_HEADER.size :]
        status = run_guarded(rank, functools.partial(_execute, worker, op, payload))
        try:
            answer = _dumps((call_id, status.for_transport()))
        except Exception as exc:
            unsendable = TypeError(
                f"the result ({type(status.result).__name__}) cannot be sent to the driver: {type(exc).__name__}: {exc}"
            )
            answer = pickle.dumps((call_id, RankStatus.from_exception(rank, unsendable).for_transport()))
        try:
            conn.send_bytes(answer)
        except OSError:
            return  # the driver is gone


def _execute(worker: Worker, op: int, payload: memoryview) -> Any:
    if op & _IN_SHM:
        name, size = pickle.loads(payload)
        segment = SharedMemory(name=name)
        try:
            payload = memoryview(bytes(_buffer(segment)[:size]))
        finally:
            segment.close()
        op &= ~_IN_SHM
    if op == _OP_FORWARD:
        request = pickle.loads(payload)
        return _export_frames(worker.execute_method("execute_forward", request))
    method, args, kwargs = pickle.loads(payload)
    return worker.execute_method(method, *args, **kwargs)


def _export_frames(output: WorkerOutput) -> tuple[WorkerOutput, _SharedFrames | None]:
    """Move the output rank's frames into a shared-memory segment the driver will copy out and unlink."""
    frames = output.frames
    if frames is None:
        return output, None
    segment = SharedMemory(create=True, size=max(1, frames.nbytes))
    try:
        view = np.ndarray(frames.shape, dtype=frames.dtype, buffer=_buffer(segment))
        view[...] = frames
        del view
        shared = _SharedFrames(segment.name, tuple(frames.shape), frames.dtype.str)
    finally:
        segment.close()
    return dataclasses.replace(output, frames=None), shared
