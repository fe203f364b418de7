"""Run by every rank under torchrun (gloo on CPU): the process groups of several layouts of the launched world.

usage: mesh_groups.py OUT_DIR LAYOUTS_JSON

LAYOUTS_JSON is a list of [replicas, cfg_degree, sp_size] or [replicas, cfg_degree, sp_size, ring_size] (USP). For each layout every rank builds its ParallelGroups and
records, into OUT_DIR/rank<rank>.json: the mesh's dimension names and rank grid, the global ranks of each of its
groups (sp, cfg, replica, replica_cpu, ulysses, ring and the decode's prefix groups), the sum of the global ranks all-reduced over
each group (a real collective: it shows who actually talks to whom), and each group's timeout.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distvideo.parallel.groups import ParallelGroups
from distvideo.parallel.layout import ParallelLayout

TIMEOUT = timedelta(seconds=77)


def describe(group: Any) -> dict[str, Any] | None:
    if group is None:
        return None
    total = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(total, group=group)
    return {
        "ranks": dist.get_process_group_ranks(group),
        "sum": int(total.item()),
        "timeout": group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
    }


def main() -> None:
    out, layouts = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo", timeout=TIMEOUT)
    world = dist.get_world_size()
    report = []
    for replicas, cfg, sp, *ring in layouts:
        layout = ParallelLayout(
            world_size=world, sp_size=sp, cfg_degree=cfg, replicas=replicas, ring_size=ring[0] if ring else 1
        )
        groups = ParallelGroups.create(layout, timeout=TIMEOUT)
        named = {"sp": groups.sp, "cfg": groups.cfg, "replica": groups.replica, "replica_cpu": groups.replica_cpu}
        named.update(ulysses=groups.ulysses, ring=groups.ring)
        report.append(
            {
                "layout": [replicas, cfg, sp, *ring],
                "dims": list(groups.mesh.mesh_dim_names or ()),
                "grid": groups.mesh.mesh.tolist(),
                "groups": {name: describe(group) for name, group in named.items()},
                "prefix": {size: describe(groups.prefix_group(size)) for size in range(2, layout.replica_size + 1)},
            }
        )
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
