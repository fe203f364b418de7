"""The mp executor's worker processes: starting them (executors/mp_start.py) around a private rendezvous, waiting for their start-up
reports, and stopping them (ask, then SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from distvideo.engine import ResolvedEngine
from distvideo.errors import RankFailure
from distvideo.executors import mp_start
from distvideo.executors.base import RankStatus
from distvideo.executors.mp_wire import (
    HEADER,
    OP_SHUTDOWN,
    STARTUP_ID,
    WAIT_SLICE_S,
    ControlBlock,
    describe_exit,
    exit_hint,
    remote_traceback,
)
from distvideo.executors.mp_worker import worker_main
from distvideo.machine import available_cores
from distvideo.parallel.planner import device_kind

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # shutdown: how long workers get to finish their call and leave by themselves
TERMINATE_GRACE_S = 2.0  # then SIGTERM, then SIGKILL
STARTUP_FAILURE_GRACE_S = 1.5  # after a rank fails to start: how long the others get to report theirs


class WorkerProcesses:
    """One spawned process per rank, each with a duplex pipe; every pipe and process sentinel is registered once in
    `poller` (`fd_owner` maps a file descriptor to (is_pipe, rank))."""

    def __init__(self, engine: ResolvedEngine):
        self.engine = engine
        self.world_size = engine.world_size
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.poller = select.poll()
        self.fd_owner: dict[int, tuple[bool, int]] = {}
        self._rendezvous_dir: str | None = None
        self.control = ControlBlock()  # the driver writes, the workers read between denoising steps

    def spawn(self) -> None:
        cuda = device_kind(self.engine.config.device) == "cuda"
        if not cuda:
            warn_if_oversubscribed(self.world_size, available_cores())
        ctx = mp_start.context(cuda=cuda)
        # A private rendezvous: a file store in a directory only this user can open (mkdtemp makes it 0700); no port
        # is chosen, released and reused, and no store listens on the network.
        self._rendezvous_dir = tempfile.mkdtemp(prefix="distvideo-rendezvous-")
        init_method = f"file://{os.path.join(self._rendezvous_dir, 'store')}"
        # The parent-death signal fires when the thread that started the worker ends: the fork server's main thread
        # (it leaves with this process), or when spawned, this thread; then only the main thread lives as long as
        # the process (the watchdog covers the other case).
        forked = ctx.get_start_method() == "forkserver"
        parent_death_signal = forked or threading.current_thread() is threading.main_thread()
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=worker_main,
                name=f"distvideo-rank{rank}",
                args=(child_end, self.engine, rank, init_method, self.control.name),
                kwargs={
                    "parent_pid": os.getpid(),
                    "parent_death_signal": parent_death_signal,
                    "driver": mp_start.DriverState(),
                },
            )
            with _sigint_blocked():  # the fork server, started by the first worker, inherits the mask too
                proc.start()
            child_end.close()  # the driver keeps its end only: a dead worker reads as end of file
            mp_start.send_stdio(parent_end)
            self.procs.append(proc)
            self.conns.append(parent_end)
            for fd, is_pipe in ((parent_end.fileno(), True), (proc.sentinel, False)):
                self.poller.register(fd, select.POLLIN)
                self.fd_owner[fd] = (is_pipe, rank)
        logger.debug("started %d workers (%s, %s)", self.world_size, ctx.get_start_method(), init_method)

    def await_startup(self) -> None:
        """Wait until every rank reports ready; on the first failure, give the others a moment to report
        theirs (a corrupt file fails every rank), then tear everything down and raise one error."""
        pending = set(range(self.world_size))
        failed: dict[int, RankStatus] = {}
        first_failed: int | None = None
        grace_end: float | None = None
        while pending:
            timeout = WAIT_SLICE_S if grace_end is None else max(0.0, min(WAIT_SLICE_S, grace_end - time.monotonic()))
            waitables: list[Any] = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
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
        self.stop(graceful=False)
        lines = [f"the mp executor could not start: {len(failed)} of {self.world_size} rank(s) failed:"]
        for rank in range(self.world_size):
            if rank in failed:
                lines.append(f"  rank {rank}: {failed[rank].error_type}: {failed[rank].error_message}")
            elif rank in pending:
                lines.append(f"  rank {rank}: torn down after rank {first_failed} failed (it was still starting)")
        lines.append(f"model: {self.engine.config.model}")
        error = RankFailure("\n".join(lines), {r: (s.error_type, s.error_message) for r, s in failed.items()})
        raise error from remote_traceback(failed.values())

    def _read_startup(self, rank: int) -> RankStatus | None:
        conn, proc = self.conns[rank], self.procs[rank]
        try:
            if conn.poll():
                call_id, status = pickle.loads(conn.recv_bytes())
                return status if call_id == STARTUP_ID else None
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
                "`if __name__ == '__main__':` (spawned workers import the main module)." + exit_hint(proc.exitcode)
            ),
        )

    def _ranks_of(self, ready: Sequence[object]) -> set[int]:
        ranks = set()
        for obj in ready:
            for rank in range(self.world_size):
                if obj is self.conns[rank] or obj == self.procs[rank].sentinel:
                    ranks.add(rank)
        return ranks

    def stop(self, graceful: bool) -> None:
        """Ask the workers to leave, then SIGTERM, then SIGKILL; close the pipes. Safe to call twice. Each step reaches
        every worker first and then waits for all of them against one deadline, so a stop takes at most
        SHUTDOWN_GRACE_S + 2 x TERMINATE_GRACE_S, however many workers there are."""
        procs = self.procs  # only started processes are listed
        if graceful:
            shutdown = HEADER.pack(0, OP_SHUTDOWN)
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(shutdown)
            _join_all(procs, SHUTDOWN_GRACE_S)
        for signame in ("SIGTERM", "SIGKILL"):
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            if graceful or signame == "SIGKILL":
                waited = SHUTDOWN_GRACE_S if signame == "SIGTERM" else TERMINATE_GRACE_S
                logger.warning("%d worker(s) did not stop within %g s; sending %s", len(alive), waited, signame)
            for proc in alive:
                with contextlib.suppress(OSError):
                    proc.terminate() if signame == "SIGTERM" else proc.kill()
            _join_all(alive, TERMINATE_GRACE_S)
        for conn in self.conns:
            conn.close()
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None
        self.control.close()


def warn_if_oversubscribed(ranks: int, cores: int) -> None:
    """More CPU ranks than cores is legal (the tests run 4 on 2), but each rank then gets a fraction of a core and the
    price is easy to miss: on a busy 2-core machine the demo request took 1.1 s on 2 ranks and 38 to 47 s on 64, which
    also took 21 to 24 s to start. Said once per executor, before any rank starts."""
    if ranks <= cores:
        return
    plural = "" if cores == 1 else "s"
    logger.warning(
        "%d CPU ranks on %d core%s: each rank gets about %.2g of a core, so start-up and every step are slow (more "
        "ranks than cores is slower than as many, not faster). Use at most %d rank%s (--num-gpus / num_gpus), or one "
        "GPU per rank.",
        ranks,
        cores,
        plural,
        cores / ranks,
        cores,
        plural,
    )


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
