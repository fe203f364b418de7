"""The process groups of a parallel layout, as named dimensions of torch's DeviceMesh, created once per worker after
the default group exists.

The mesh has the layout's degrees as dimensions, in its rank order (layout.py): ``replica`` (the replicas), ``cfg``
(the two guidance branches), ``sp`` (sequence parallelism); a dimension of degree 1 is left out, as in torchtitan's
``ParallelDims``, since it would only create one-rank groups. The group along a dimension holds the ranks whose other
coordinates equal this rank's: ``mesh.get_group("sp")`` is its sequence-parallel group, ``"cfg"`` its CFG pair. The
ranks of this rank's replica, the ones that run a request together, are every cfg and sp coordinate at its replica
coordinate: the dimension ``cfg_sp`` of a second mesh, (replica, cfg_sp). torch flattens dimensions only with a
private method (``DeviceMesh._flatten``), so the second mesh is built with the public ``init_device_mesh`` instead;
it is needed only when both cfg and sp are on (otherwise the replica is the ``sp`` or the ``cfg`` dimension).

Under USP (``sp = ulysses x ring``, both above 1) a third mesh splits ``sp`` into ``ring`` (outer) and ``ulysses``
(inner), (replica, cfg, ring, ulysses), for the same reason (no public way to unflatten a dimension). With one of
them of degree 1 the other is the ``sp`` dimension itself: pure ring attention passes its key/value blocks over
``sp``, pure Ulysses runs its all-to-alls over ``sp``.

The control messages (the stop check after a step, the memory check of a request) are CPU tensors over the replica's
ranks, so the replica's dimension has a gloo twin when the device backend is not gloo; on CPU the device groups are
gloo already and the twin is the same group.

Creating groups is collective over the whole world: every rank creates every group, in the same order, even the
groups it is not in. The decode's band groups whose size is no dimension (a band count follows the latent height,
not the layout) are prefixes of a replica's ranks, made with ``new_group``; with several replicas they are created
up front: replicas run different requests, so no group can be created in the middle of one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distvideo.models import compat
from distvideo.parallel.collectives import collective
from distvideo.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

MESH_DIMS = ("replica", "cfg", "sp")  # the layout's rank order: rank = (replica * cfg + cfg_rank) * sp + sp_rank
REPLICA_DIMS = ("replica", "cfg_sp")  # cfg_sp: the ranks of one replica, cfg and sp flattened in the same order
USP_DIMS = ("replica", "cfg", "ring", "ulysses")  # sp split: sp_rank = ring_rank * ulysses_size + ulysses_rank


def mesh_dims(layout: ParallelLayout) -> dict[str, int]:
    """The dimensions of the layout's mesh and their sizes, outermost first; those of degree 1 are left out."""
    degrees = {"replica": layout.replicas, "cfg": layout.cfg_degree, "sp": layout.sp_size}
    return {name: degrees[name] for name in MESH_DIMS if degrees[name] > 1}


def replica_mesh_dims(layout: ParallelLayout) -> dict[str, int]:
    """The dimensions of the (replica, cfg_sp) mesh: cfg_sp holds the ranks of one replica."""
    degrees = {"replica": layout.replicas, "cfg_sp": layout.replica_size}
    return {name: degrees[name] for name in REPLICA_DIMS if degrees[name] > 1}


def usp_mesh_dims(layout: ParallelLayout) -> dict[str, int]:
    """The dimensions of the (replica, cfg, ring, ulysses) mesh; those of degree 1 are left out."""
    degrees = {
        "replica": layout.replicas,
        "cfg": layout.cfg_degree,
        "ring": layout.ring_size,
        "ulysses": layout.ulysses_size,
    }
    return {name: degrees[name] for name in USP_DIMS if degrees[name] > 1}


def replica_dim(layout: ParallelLayout) -> str | None:
    """The dimension that holds the ranks of one replica: ``sp`` or ``cfg`` when only one of them is on, ``cfg_sp``
    (of the replica mesh) when both are, None for replicas of one rank."""
    if layout.cfg_enabled and layout.sp_enabled:
        return "cfg_sp"
    if layout.sp_enabled:
        return "sp"
    return "cfg" if layout.cfg_enabled else None


def _options(backend: str, timeout: timedelta | None) -> Any:
    """The backend options carrying `timeout` (dist_timeout reaches every group): init_device_mesh takes a timeout
    only inside them. None: torch's default timeout, as for any group created without one."""
    if timeout is None:
        return None
    return compat.backend_options(backend, timeout)


def _build_mesh(device_type: str, dims: dict[str, int], *, backend: str, timeout: timedelta | None) -> DeviceMesh:
    """init_device_mesh over `dims`, every group on `backend`, each with `timeout`. Without an override a dimension
    as large as the world is the default group (which has the timeout), but under a gloo default with CUDA present
    torch makes a new one without it, so gloo dimensions always get the override; under NCCL the default group is
    reused (a communicator costs device memory)."""
    default_backend = str(dist.get_backend())
    world_size = dist.get_world_size()
    override: dict[int | str, Any] = {}
    for name, size in dims.items():
        if backend != default_backend:
            override[name] = (backend, _options(backend, timeout))
        elif timeout is not None and (size < world_size or backend == "gloo"):
            override[name] = _options(backend, timeout)
    return init_device_mesh(
        device_type, tuple(dims.values()), mesh_dim_names=tuple(dims), backend_override=override or None
    )


@dataclass
class ParallelGroups:
    layout: ParallelLayout
    rank: int
    backend: str  # of the device groups: "gloo" on CPU, "nccl" on CUDA
    mesh: DeviceMesh  # dims replica x cfg x sp (those of degree > 1), device backend
    replica_mesh: DeviceMesh | None  # the mesh holding replica_dim (device backend); None for replicas of one rank
    replica_mesh_cpu: DeviceMesh | None  # its gloo twin, dims replica x cfg_sp (the same mesh on CPU)
    timeout: timedelta | None = None
    usp_mesh: DeviceMesh | None = None  # dims replica x cfg x ring x ulysses, when both ring and ulysses are > 1
    _prefix_groups: dict[int, Any] = field(default_factory=dict)

    def replica_device_mesh(self) -> DeviceMesh | None:
        """The 1-D device mesh of this rank's replica (its ranks run a request together), None for one rank."""
        dim = replica_dim(self.layout)
        if dim is None or self.replica_mesh is None:
            return None
        return self.replica_mesh[dim]

    @classmethod
    def create(
        cls, layout: ParallelLayout, *, device_type: str = "cpu", timeout: timedelta | None = None
    ) -> ParallelGroups:
        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups.create needs the default process group (init_process_group) first")
        if dist.get_world_size() != layout.world_size:
            raise RuntimeError(
                f"the process group has {dist.get_world_size()} ranks but the layout says {layout.describe()}"
            )
        rank = dist.get_rank()
        backend = str(dist.get_backend())

        def build(device: str, dims: dict[str, int], on: str) -> DeviceMesh:
            return _build_mesh(device, dims, backend=on, timeout=timeout)

        with collective("creating the layout's process groups"):
            mesh = build(device_type, mesh_dims(layout), backend)
            replica_mesh = replica_mesh_cpu = None
            if replica_dim(layout) == "cfg_sp":
                replica_mesh = build(device_type, replica_mesh_dims(layout), backend)
            elif replica_dim(layout) is not None:
                replica_mesh = mesh
            if replica_mesh is not None:
                gloo = backend == "gloo"  # on CPU the device groups are the twins
                replica_mesh_cpu = replica_mesh if gloo else build("cpu", replica_mesh_dims(layout), "gloo")
            usp_mesh = None
            if layout.ring_enabled and layout.ulysses_size > 1:
                usp_mesh = build(device_type, usp_mesh_dims(layout), backend)
        logger.debug("rank %d: process groups for %s (%s): %s", rank, layout.describe(), backend, mesh)
        groups = cls(layout, rank, backend, mesh, replica_mesh, replica_mesh_cpu, timeout, usp_mesh=usp_mesh)
        if layout.replicas > 1:
            for size in range(2, layout.replica_size):  # the decode's prefix groups, now rather than mid-request
                groups.prefix_group(size)
        return groups

    # -- the groups, by mesh dimension ------------------------------------------------------------------------------
    @property
    def sp(self) -> Any:
        """This rank's sequence-parallel group: mesh dimension ``sp`` (None when sp_size == 1)."""
        return self.mesh.get_group("sp") if self.layout.sp_enabled else None

    @property
    def ulysses(self) -> Any:
        """This rank's Ulysses group (the all-to-alls): ``ulysses`` of the USP mesh, or ``sp`` without ring
        attention (None when the Ulysses degree is 1)."""
        if self.layout.ulysses_size == 1:
            return None
        return self.usp_mesh.get_group("ulysses") if self.usp_mesh is not None else self.sp

    @property
    def ring(self) -> Any:
        """This rank's ring group (the key/value passes, group rank = ring_rank): ``ring`` of the USP mesh, or
        ``sp`` without Ulysses (None without ring attention)."""
        if not self.layout.ring_enabled:
            return None
        return self.usp_mesh.get_group("ring") if self.usp_mesh is not None else self.sp

    @property
    def ulysses_rank(self) -> int:
        return self.layout.ulysses_rank(self.rank)

    @property
    def ring_rank(self) -> int:
        return self.layout.ring_rank(self.rank)

    @property
    def cfg(self) -> Any:
        """This rank's CFG pair: mesh dimension ``cfg``, group rank = cfg_rank (None when CFG parallelism is off)."""
        return self.mesh.get_group("cfg") if self.layout.cfg_enabled else None

    @property
    def replica(self) -> Any:
        """The ranks of this rank's replica (device backend): mesh dimension `replica_dim` (None: one rank)."""
        dim = replica_dim(self.layout)
        return None if self.replica_mesh is None or dim is None else self.replica_mesh.get_group(dim)

    @property
    def replica_cpu(self) -> Any:
        """The gloo twin of `replica`, for control messages: dimension ``cfg_sp`` of the gloo replica mesh."""
        if self.replica_mesh_cpu is None:
            return None
        dim = replica_dim(self.layout) if self.replica_mesh_cpu is self.replica_mesh else "cfg_sp"
        return self.replica_mesh_cpu.get_group(dim)

    @property
    def sp_rank(self) -> int:
        return self.layout.sp_rank(self.rank)

    @property
    def replica_rank(self) -> int:
        return self.layout.replica_rank(self.rank)

    @property
    def cfg_rank(self) -> int:
        return self.layout.cfg_rank(self.rank)

    def prefix_group(self, size: int) -> Any:
        """The group of this replica's first `size` ranks (device backend), for a decode that uses fewer ranks than
        the replica; ranks outside the prefix get None. The whole replica is `replica`; the first CFG half is the
        ``sp`` dimension. Any other size is no dimension of the mesh (the band count follows the latent height):
        a `new_group` per replica.

        One replica: created on first use (all ranks run the same requests, so they ask for the same sizes in the
        same order). Several: created up front, for every replica (see the module docstring).
        """
        if size == self.layout.replica_size:
            return self.replica
        if size == self.layout.sp_size:
            return self.sp if self.cfg_rank == 0 else None
        if size not in self._prefix_groups:
            mine = None
            with collective("creating the decode's process group"):
                for base in self.layout.output_ranks():  # every rank creates every replica's group, in order
                    group = dist.new_group(ranks=list(range(base, base + size)), timeout=self.timeout)
                    if base <= self.rank < base + size:
                        mine = group
            self._prefix_groups[size] = mine
        return self._prefix_groups[size]
