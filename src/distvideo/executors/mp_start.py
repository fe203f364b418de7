"""How the mp executor's workers start: forked from a preloaded fork server, with the driver's state of the moment.

A spawned worker is a new interpreter that imports torch, diffusers and distvideo again (about 4 s of CPU on a
laptop, per rank, every time an executor starts). The workers are forked instead from multiprocessing's fork server,
a clean single-threaded process started once per driver process (before any executor exists, from the same
interpreter and `sys.path`) that has imported those modules already (`PRELOAD`): a second executor in the same
driver (a notebook, a service restarting its engine, a test suite) starts its ranks in a fraction of a second. The
fork server never runs torch code, creates no device context and holds no process group, so what a worker inherits
is only imported modules.

What a spawned process would have taken from the driver at the moment it started, a forked one takes from the fork
server as it was when *it* started. multiprocessing itself sends the working directory, `sys.path` and the main
module with each new process; the rest of the driver's present state is carried here and applied first thing in the
worker: its environment (`DriverState`; distvideo reads its variables lazily, at use), umask and CPU affinity, and its
standard output and error descriptors (a log redirected since, pytest's per-test capture), passed over the worker's pipe with SCM_RIGHTS
(`socket.send_fds`).

`DISTVIDEO_MP_START=spawn` goes back to spawning (a platform without a fork server uses it anyway, and so do workers
that will use CUDA: see `context`).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from distvideo import envs

#: What a rank imports before its first call; a module that fails to import is left to the worker (and its error).
PRELOAD = ("distvideo.executors.mp_worker", "distvideo.worker", "distvideo.media", "distvideo.models.preload")
STDIO = (1, 2)


def context(cuda: bool = False) -> Any:  # multiprocessing's context type is not public
    """The start method's context: the fork server, or spawning when asked (`DISTVIDEO_MP_START=spawn`), when the
    platform has no fork server, or when the workers will use CUDA (`cuda`). On a CUDA build of torch, importing
    diffusers asks the driver for its devices (`diffusers.utils.torch_utils` calls `torch.accelerator.is_available()`
    at import), and torch then refuses CUDA in every process forked afterwards: on an H200 with torch 2.11 every rank
    forked from the fork server failed with "Cannot re-initialize CUDA in forked subprocess". A GPU rank's import time
    is small beside its model load; the fork server is for the CPU, where ranks start often (tests, notebooks)."""
    method = envs.get("DISTVIDEO_MP_START")
    if method == "forkserver" and (cuda or "forkserver" not in multiprocessing.get_all_start_methods()):
        method = "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the fork server starts (the first worker)
    return ctx


def _umask() -> int:
    mask = os.umask(0o077)  # reading the umask means setting it: put it back at once
    os.umask(mask)
    return mask


def _affinity() -> frozenset[int] | None:
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


@dataclass(frozen=True)
class DriverState:
    """What a worker takes from its driver at the moment it is started, beyond what multiprocessing carries itself
    (the working directory, `sys.path` and the main module): the environment, the umask (the modes of the files it
    writes) and the CPUs it may run on (its thread count follows them)."""

    environ: dict[str, str] = field(default_factory=envs.whole_environment)
    umask: int = field(default_factory=_umask)
    cpus: frozenset[int] | None = field(default_factory=_affinity)

    def apply(self) -> None:
        envs.replace_environment(self.environ)
        os.umask(self.umask)
        if self.cpus is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cpus)


def send_stdio(conn: Connection) -> None:
    """The driver's standard output and error, as they are now, to the worker at the other end of `conn`."""
    fds = [fd for fd in STDIO if _is_open(fd)]
    mask = sum(1 << STDIO.index(fd) for fd in fds)
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        socket.send_fds(sock, [bytes([mask])], fds)


def receive_stdio(conn: Connection) -> bool:
    """In the worker, before anything else reads `conn`: make the driver's descriptors its own standard output and
    error. False when the driver closed the pipe first (it is gone)."""
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        data, fds, _, _ = socket.recv_fds(sock, 1, len(STDIO))
    if not data:
        return False
    wanted = [fd for i, fd in enumerate(STDIO) if data[0] & (1 << i)]
    for target, received in zip(wanted, fds, strict=True):
        os.dup2(received, target)
        os.close(received)
    return True


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
