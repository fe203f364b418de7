"""Where the Ray executor's ranks live: joining (or starting) the cluster, the bundles it must have, the rank order
over nodes, and how the ranks meet (a private file store when they all run beside the driver, else env://)."""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

from distvideo.engine import ResolvedEngine
from distvideo.errors import ConfigError
from distvideo.models import compat

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # an address that does not answer within this is unreachable
LOOPBACK = "127.0.0.1"


def connect(address: str | None) -> bool:
    """Join the cluster at `address` ('auto': any on this machine, or HOST:PORT), else the running one Ray would join
    (RAY_ADDRESS, or the cluster `ray start` recorded), else start a local one on 127.0.0.1.
    Whether this call connected (False: the process was already connected, and stays so after shutdown)."""
    import ray

    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": True}
    if address not in (None, "auto"):
        assert address is not None
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise ConfigError(
                f"ray_address={address!r}: no Ray cluster answers there within {CONNECT_TIMEOUT_S:g} s ({exc}); "
                "give the head node's GCS address (ray start --head prints it) or 'auto'"
            ) from None
    try:
        running = _running_cluster(address)
    except ConnectionError:
        raise ConfigError("ray_address='auto': no running Ray cluster found on this machine") from None
    if running is None:
        logger.info("no running Ray cluster: starting a local one on %s", LOOPBACK)
        start_local_cluster(**options)
        return True
    loopback = running.rpartition(":")[0] in (LOOPBACK, "localhost", "::1", "[::1]")
    try:
        with (
            compat.ray_single_machine_mode() if loopback else contextlib.nullcontext()
        ):  # a cluster on loopback stays there
            # the address as given, not `running`: Ray turns on token authentication (on by default for `ray start`)
            # only for a cluster it finds itself, never for an explicit address, so joining the resolved address of
            # a cluster `ray start` made fails with an authentication error
            ray.init(address=address, **options)
    except ConnectionError as exc:
        raise ConfigError(
            f"ray_address={address!r}: could not join the Ray cluster at {running} ({exc}); where the cluster uses "
            "token authentication (the default of `ray start`), an explicit address also needs RAY_AUTH_MODE=token "
            "and the cluster's token (RAY_AUTH_TOKEN or ~/.ray/auth_token)"
        ) from None
    return True


def _running_cluster(address: str | None) -> str | None:
    """The GCS address `ray.init(address)` would join, or None where it would start a cluster (`address` None, and
    neither RAY_ADDRESS nor a cluster `ray start` recorded). 'auto' also finds a cluster by its GCS process, and
    raises ConnectionError where there is none. Resolved in single-machine mode, so that a cluster on 127.0.0.1 keeps
    that address (Ray would otherwise turn it into the host's reachable one, where such a cluster does not listen)."""
    with compat.ray_single_machine_mode():
        return compat.ray_bootstrap_address(address)


def start_local_cluster(**options: Any) -> Any:
    """`ray.init` of a new single-machine cluster whose every process listens on 127.0.0.1 only."""
    import ray

    with compat.ray_single_machine_mode():  # every server of the cluster on loopback (compat.py says why)
        return ray.init(address="local", _node_ip_address=LOOPBACK, **options)


def bundles_for(engine: ResolvedEngine, cluster: dict[str, float]) -> list[dict[str, float]]:
    """One bundle per rank: a GPU where the ranks run on CUDA (device 'cuda...', or unset on a cluster with GPUs)."""
    device = engine.config.device or ("cuda" if cluster.get("GPU", 0) > 0 else "cpu")
    kind = "GPU" if device.startswith("cuda") else "CPU"
    return [{kind: 1.0} for _ in range(engine.world_size)]


def check_resources(bundles: list[dict[str, float]], cluster: dict[str, float]) -> None:
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    short = {k: v for k, v in need.items() if cluster.get(k, 0.0) < v}
    if short:
        has = ", ".join(f"{k}={v:g}" for k, v in sorted(cluster.items()) if k in ("CPU", "GPU") or k in need)
        raise ConfigError(
            f"the Ray cluster is too small: {len(bundles)} bundle(s) {bundles[0]} needed (num_gpus={len(bundles)}), "
            f"it has {has or 'nothing'}; add nodes or pass a smaller num_gpus"
        )


def rank_order(driver_node: str, nodes: list[str]) -> list[int]:
    """Bundle indices in rank order: grouped by node, the driver's node first, then nodes as Ray placed them."""
    first_seen = {node: i for i, node in reversed(list(enumerate(nodes)))}
    return sorted(range(len(nodes)), key=lambda i: (nodes[i] != driver_node, first_seen[nodes[i]], i))


def rendezvous_kind(driver_node: str, nodes: list[str], addresses: dict[str, str]) -> tuple[str, str | None]:
    """How ranks on `nodes` (node ids, rank order) meet, and the host of an env:// rendezvous:
    - every rank on the driver's node: ("file", None), a file store in a directory the driver makes (nothing listens);
    - every rank on nodes of one address (one machine, e.g. emulated nodes): ("env", 127.0.0.1);
    - else ("env", the address Ray registered for rank 0's node).
    gloo binds loopback in the first two cases."""
    if all(node == driver_node for node in nodes):
        return "file", None
    if len({addresses[node] for node in nodes}) == 1:
        return "env", LOOPBACK
    return "env", addresses[nodes[0]]
