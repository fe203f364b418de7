"""The mp executor's worker process: one rank (forked from the fork server, or spawned: executors/mp_start.py) that
starts a Worker, reports, and serves the driver's calls until shutdown or end of file; it ends itself when the driver
dies (parent death signal, a watchdog on the driver's pid and its own parent's, end of file on the pipe)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any, NoReturn

from distvideo.engine import ResolvedEngine
from distvideo.executors import mp_start
from distvideo.executors.base import RankStatus, call_hooks, run_guarded
from distvideo.executors.mp_wire import (
    HEADER,
    IN_SHM,
    OP_SHUTDOWN,
    STARTUP_ID,
    ControlBlock,
    Note,
    WireCall,
    dumps_shared,
    segment_buffer,
)
from distvideo.machine import bind_gloo_to_loopback

if TYPE_CHECKING:
    from distvideo.worker import Worker

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def _set_parent_death_signal(sig: int) -> bool:
    """Linux prctl(PR_SET_PDEATHSIG): the kernel sends `sig` when the parent (thread) ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(1, sig, 0, 0, 0)) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _driver_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_parent(parent_pid: int, parent: int) -> None:
    """Leave when the driver is gone, even while the main thread is busy in a call: re-parented (`parent` is the
    driver, or the fork server that forked this worker and leaves with the driver), or the driver no longer exists."""
    while True:
        if os.getppid() != parent or not _driver_alive(parent_pid):
            os._exit(1)
        time.sleep(PARENT_POLL_S)


def _detach_stdin() -> None:
    # multiprocessing replaces sys.stdin, but descriptor 0 still points at the driver's terminal
    with contextlib.suppress(OSError):
        fd = os.open(os.devnull, os.O_RDONLY)
        if fd != 0:
            os.dup2(fd, 0)
            os.close(fd)


def worker_main(
    conn: Connection,
    engine: ResolvedEngine,
    rank: int,
    init_method: str,
    control_name: str,
    *,
    parent_pid: int,
    parent_death_signal: bool,
    driver: mp_start.DriverState,
) -> None:
    """One rank: take the driver's state, start the Worker, report, then serve calls until shutdown or end of file."""
    if not mp_start.receive_stdio(conn):  # the driver closed the pipe before sending: it is gone
        os._exit(1)
    driver.apply()
    if parent_death_signal:
        _set_parent_death_signal(signal.SIGKILL)
    parent = os.getppid()  # the driver (spawned) or the fork server (forked), read after the signal is armed
    if not _driver_alive(parent_pid) or parent == 1:  # the driver died before the signal was armed
        os._exit(1)
    watchdog = threading.Thread(target=_watch_parent, args=(parent_pid, parent), name="distvideo-parent-watchdog")
    watchdog.daemon = True
    watchdog.start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the driver decides
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked at spawn; ignored from now on
    _detach_stdin()
    bind_gloo_to_loopback()

    from tqdm import tqdm

    from distvideo.logging_utils import configure_logging, set_log_rank
    from distvideo.worker import RankInfo, Worker

    # tqdm's default lock includes a named POSIX semaphore (for bars shared between processes). A worker that is
    # SIGKILLed cannot unlink it, and the resource tracker then warns about leaked semaphores when the driver exits.
    # A worker's bars are its own: a lock local to the process is enough.
    tqdm.set_lock(threading.RLock())
    set_log_rank(rank)
    configure_logging(engine.config.log_level)
    # What this process holds now is the imported modules (torch, diffusers, ...: about 440,000 objects), forked from
    # the fork server and shared with it page by page. A full collection walks every tracked object and writes to its
    # header: a rank's first one (at the latest the one Worker.shutdown runs on the way out) took 0.28 CPU-seconds and
    # copied 91 MB of shared pages into the rank, and 64 ranks leaving together on 2 cores then overran the driver's
    # shutdown grace. Frozen, those objects are never collected (they live as long as the process anyway), and a
    # collection walks only what the rank made itself (about 18,000 objects, 3 ms).
    gc.freeze()
    rank_info = RankInfo.spawned(rank, engine.world_size, init_method)
    worker: Worker | None = None
    phase = "Worker()"
    try:
        worker = Worker(engine, rank_info)
        phase = "init_device"
        worker.init_device()
        phase = "load_model"
        worker.load_model()
    except BaseException as exc:
        status = RankStatus.from_exception(rank, exc)
        status.error_message = f"{status.error_message} (in {phase})"
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps((STARTUP_ID, status.for_transport())))
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.shutdown()
        _leave(1)
    conn.send_bytes(pickle.dumps((STARTUP_ID, RankStatus(rank=rank, ok=True, result="ready"))))
    try:
        _serve(conn, worker, rank, ControlBlock(control_name))
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


def _serve(conn: Connection, worker: Worker, rank: int, control: ControlBlock) -> None:
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            logger.debug("the driver closed the pipe; leaving")
            return
        call_id, op = HEADER.unpack_from(message)
        if op == OP_SHUTDOWN:
            return
        payload = memoryview(message)[HEADER.size :]
        call = functools.partial(_execute, worker, op, payload, conn, call_id, control)
        status = run_guarded(rank, call)
        try:
            answer = dumps_shared((call_id, status.for_transport()))
        except Exception as exc:
            unsendable = TypeError(
                f"the result ({type(status.result).__name__}) cannot be sent to the driver: {type(exc).__name__}: {exc}"
            )
            answer = pickle.dumps((call_id, RankStatus.from_exception(rank, unsendable).for_transport()))
        try:
            conn.send_bytes(answer)
        except OSError:
            return  # the driver is gone


def _execute(
    worker: Worker, op: int, payload: memoryview, conn: Connection, call_id: int, control: ControlBlock
) -> Any:  # whatever the called worker method returns
    if op & IN_SHM:
        name, size = pickle.loads(payload)
        segment = SharedMemory(name=name)
        try:
            payload = memoryview(bytes(segment_buffer(segment)[:size]))
        finally:
            segment.close()
    call: WireCall = pickle.loads(payload)
    replies = call.unique_reply_rank in (None, worker.rank)

    def emit(value: Any) -> None:  # an event of this rank, to the driver's on_event (arrays via shared memory)
        conn.send_bytes(dumps_shared((call_id, Note(value))))

    def cancelled() -> bool:
        return control.cancelled(call_id)

    kwargs = call_hooks(call.kwargs, emit if call.events and replies else None, cancelled if call.stoppable else None)
    result = worker.execute_method(call.method, *call.args, **kwargs)
    return result if replies else None  # with unique_reply_rank, the other ranks send their status only
