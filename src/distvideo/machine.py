"""This machine as a process sees it, without torch: the cores it may run on, and gloo kept to its loopback
interface for ranks that all live here."""

from __future__ import annotations

import logging
import os
import socket

from distvideo import envs

logger = logging.getLogger(__name__)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which the ranks it starts inherit)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def bind_gloo_to_loopback() -> None:
    """Ranks all on this machine (spawned workers, the layout probe's ranks): gloo listens on the loopback interface
    only (it would otherwise bind to the address the host name resolves to, reachable from the network)."""
    loopback = next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
    if loopback is not None:
        envs.set_external({"GLOO_SOCKET_IFNAME": loopback})
    else:
        logger.debug("no loopback interface found; gloo binds where the host name resolves")
