"""One local Ray cluster for the whole test session, shared by every module that runs the Ray executor.

Use: ``from ray_cluster import session_cluster  # noqa: F401`` in a test module, then ask for the fixture
`ray_cluster` (its value: the cluster's GCS address). pytest keeps one fixture per module that imports it, so the cluster itself is a process-wide one here: the
first module to ask starts it (through the executor's own `start_local_cluster`: node 127.0.0.1, 4 CPUs, no
dashboard), the last fixture torn down (at the end of the session) stops it. The actors import the tests' helper
modules as spawned mp workers do: the tests folder is on their path (the job's runtime_env), before the driver's
PYTHONPATH.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).resolve().parent
_CLUSTER: dict[str, object] = {"users": 0, "address": None}


@pytest.fixture(scope="session", name="ray_cluster")
def session_cluster():
    import ray

    from distvideo.executors.ray_placement import start_local_cluster

    if _CLUSTER["users"] == 0:
        # ray.init installs its own SIGTERM handler in the driver; a test that asks for the cluster mid-call (through
        # getfixturevalue) must still leave the signal state as it found it (conftest's hygiene check)
        sigterm = signal.getsignal(signal.SIGTERM)
        context = start_local_cluster(
            num_cpus=4,
            include_dashboard=False,
            logging_level="WARNING",
            # the tests folder, then the driver's own path (a worktree's src/ run with PYTHONPATH=src): the actors
            # import the code under test, as spawned mp workers do, not whatever the environment installed
            runtime_env={
                "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
            },
        )
        signal.signal(signal.SIGTERM, sigterm)
        _CLUSTER["address"] = context.address_info["gcs_address"]
    _CLUSTER["users"] = int(_CLUSTER["users"]) + 1  # type: ignore[call-overload]
    yield _CLUSTER["address"]
    _CLUSTER["users"] = int(_CLUSTER["users"]) - 1  # type: ignore[call-overload]
    if _CLUSTER["users"] == 0:
        ray.shutdown()


def leftovers(within: float = 10.0) -> tuple[list, float]:
    """(placement groups not removed, CPUs still held): ([], 0) once every actor and placement group is gone."""
    import ray

    deadline = time.monotonic() + within
    while True:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
        if (not groups and held == 0) or time.monotonic() > deadline:
            return groups, held
        time.sleep(0.2)


def listening(pids: Iterable[int]) -> dict[int, list[str]]:
    """pid -> the addresses its TCP sockets listen on (processes gone meanwhile are left out)."""
    out: dict[int, list[str]] = {}
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        out[pid] = [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, how a dual-stack socket shows 127.0.0.1
    return (mapped or address).is_loopback
