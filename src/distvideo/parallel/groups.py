"""The process groups of a parallel layout, created once per worker after the default group exists.

`torch.distributed.new_group` is collective over the whole world: every rank creates every group, in the same
order, even the groups it is not in. Each group has a CPU (gloo) twin for control messages; on CPU the device
groups are gloo already and the twins are the same objects. With several replicas every group is created up front
(the decode's smaller groups included): replicas run different requests, so no group can be created in the middle
of one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from distvideo.parallel.collectives import collective
from distvideo.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)


@dataclass
class ParallelGroups:
    layout: ParallelLayout
    rank: int
    backend: str  # of the device groups: "gloo" on CPU, "nccl" on CUDA
    world: Any  # the default group (device backend)
    world_cpu: Any
    sp: Any  # this rank's sequence-parallel group (None when sp_size == 1)
    sp_cpu: Any
    cfg: Any  # this rank's CFG pair (None when CFG parallelism is off)
    cfg_cpu: Any
    replica: Any = None  # this rank's replica (the world when there is one replica)
    replica_cpu: Any = None
    timeout: timedelta | None = None
    _prefix_groups: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, layout: ParallelLayout, *, timeout: timedelta | None = None) -> ParallelGroups:
        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups.create needs the default process group (init_process_group) first")
        if dist.get_world_size() != layout.world_size:
            raise RuntimeError(
                f"the process group has {dist.get_world_size()} ranks but the layout says {layout.describe()}"
            )
        rank = dist.get_rank()
        backend = str(dist.get_backend())
        world = dist.group.WORLD
        with collective("creating the layout's process groups"):
            world_cpu = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)

        def mine(all_ranks: list[list[int]]) -> tuple[Any, Any]:
            device_group = cpu_group = None
            for ranks in all_ranks:  # every rank creates every group, in the same order
                g = dist.new_group(ranks=ranks, timeout=timeout)
                g_cpu = g if backend == "gloo" else dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
                if rank in ranks:
                    device_group, cpu_group = g, g_cpu
            return device_group, cpu_group

        with collective("creating the layout's process groups"):
            sp, sp_cpu = mine(layout.sp_group_ranks()) if layout.sp_enabled else (None, None)
            cfg, cfg_cpu = mine(layout.cfg_group_ranks()) if layout.cfg_enabled else (None, None)
            replica, replica_cpu = mine(layout.replica_group_ranks()) if layout.replicas > 1 else (world, world_cpu)
        logger.debug("rank %d: process groups for %s (%s)", rank, layout.describe(), backend)
        groups = cls(layout, rank, backend, world, world_cpu, sp, sp_cpu, cfg, cfg_cpu, replica, replica_cpu, timeout)
        if layout.replicas > 1:
            for size in range(2, layout.replica_size):  # the decode's prefix groups, now rather than mid-request
                groups.prefix_group(size)
        return groups

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
        """The group of this replica's first `size` ranks (device backend), e.g. for a decode that uses fewer ranks
        than the replica. Ranks outside the prefix get None.

        One replica: created on first use (all ranks run the same requests, so they ask for the same sizes in the
        same order). Several: created up front, for every replica (see the module docstring).
        """
        if size == self.layout.replica_size:
            return self.replica
        if size not in self._prefix_groups:
            mine = None
            with collective("creating the decode's process group"):
                for base in self.layout.output_ranks():  # every rank creates every replica's group, in order
                    group = dist.new_group(ranks=list(range(base, base + size)), timeout=self.timeout)
                    if base <= self.rank < base + size:
                        mine = group
            self._prefix_groups[size] = mine
        return self._prefix_groups[size]
