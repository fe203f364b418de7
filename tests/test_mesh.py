"""Process groups come from one named device mesh (issue 27): every collective of ours names its group, and the
mesh's groups are the layout's, per layout, on 8 real ranks.

The static half scans the source: a torch.distributed collective outside executors/ without a ``group=`` (or with
None or the world group) fails it, and so does a group made anywhere but the two places that may (the decode's
prefix groups, the worker's world-wide control group). With groups made only by ``init_device_mesh`` (in
parallel/groups.py) and those two, every group a collective names is a mesh dimension or one of the two. The launched
half builds each layout's groups under torchrun on CPU (gloo) and checks their ranks against the layout's rank order,
with a real all-reduce over each group.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from distvideo.parallel.groups import mesh_dims, replica_dim
from distvideo.parallel.layout import ParallelLayout
from launch_groups import torchrun_case

from conftest import REPO
from launchers import format_output

SRC = REPO / "src" / "distvideo"
SCRIPT = REPO / "tests" / "parallel_scripts" / "mesh_groups.py"

COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",  # a point-to-point op for batch_isend_irecv: its group is the 4th argument
}
# where a group may be created other than by init_device_mesh: (file, enclosing function) -> why
GROUP_MAKERS = {
    ("parallel/groups.py", "prefix_group"): "a band count follows the latent height: no dimension of the mesh",
    ("worker.py", "init_device"): "the world-wide gloo group of the external executor's status exchange",
}


def _is_dist(node: ast.expr, aliases: set[str]) -> bool:
    """`torch.distributed`, or a name it was imported as."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr == "distributed"


def _names_world_or_none(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    return isinstance(node, ast.Attribute) and node.attr == "WORLD"


def unnamed_groups(source: str, where: str) -> list[str]:
    """Every torch.distributed collective in `source` whose group is missing, None or the world group."""
    found, tree = [], ast.parse(source)
    aliases = {"dist"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for name in node.names:  # a bare collective would escape the scan below
                if name.name in COLLECTIVES:
                    found.append(
                        f"{where}:{node.lineno}: import {name.name} from torch.distributed: call dist.{name.name}"
                    )
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in COLLECTIVES or not _is_dist(node.func.value, aliases):
            continue
        group = next((k.value for k in node.keywords if k.arg == "group"), None)
        if group is None and node.func.attr == "P2POp" and len(node.args) >= 4:
            group = node.args[3]
        if group is None or _names_world_or_none(group):
            found.append(f"{where}:{node.lineno}: dist.{node.func.attr} without a mesh group")
    return found


def group_makers(source: str, where: str) -> list[tuple[str, str, int]]:
    """(file, enclosing function, line) of every new_group / init_device_mesh call in `source`."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in ("new_group", "new_subgroups", "split_group", "init_device_mesh"):
                    found.append((where, f"{function}:{name}", child.lineno))
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def _sources() -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(SRC)), path.read_text())
        for path in sorted(SRC.rglob("*.py"))
        # the executors' status exchange is world-wide on purpose, and so are the probe's collectives: its own
        # processes, measuring the machine before any engine (parallel/probe.py)
        if path.relative_to(SRC).parts[0] != "executors" and path.relative_to(SRC).as_posix() != "parallel/probe.py"
    ]


def test_every_collective_names_a_mesh_group():
    problems = [p for where, source in _sources() for p in unnamed_groups(source, where)]
    assert problems == [], "\n".join(problems)


def test_groups_are_made_by_the_mesh_or_a_listed_exception():
    made = [m for where, source in _sources() for m in group_makers(source, where)]
    meshes = [m for m in made if m[1].endswith(":init_device_mesh")]
    assert meshes and {m[0] for m in meshes} == {"parallel/groups.py"}, meshes
    others = [(where, f"{what}@{line}") for where, what, line in made if not what.endswith(":init_device_mesh")]
    unlisted = [o for o in others if (o[0], o[1].split(":")[0]) not in GROUP_MAKERS]
    assert unlisted == [], f"groups made outside the mesh; list them in GROUP_MAKERS with why: {unlisted}"


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("dist.all_reduce(x)", 1),
        ("torch.distributed.broadcast(x, src=0)", 1),
        ("dist.all_gather(out, x, group=None)", 1),
        ("dist.barrier(group=dist.group.WORLD)", 1),
        ("dist.P2POp(dist.isend, x, 1)", 1),
        ("import torch.distributed as c10d\nc10d.all_reduce(x)", 1),
        ("from torch.distributed import all_reduce", 1),
        ("dist.all_reduce(x, group=self.groups.replica)", 0),
        ("dist.P2POp(dist.isend, x, 1, band.group)", 0),
        ("dist.get_rank()", 0),
    ],
)
def test_the_scan_sees_a_collective_without_a_group(source, flagged):
    assert len(unnamed_groups(source, "snippet")) == flagged


def test_the_scan_sees_a_group_made_outside_the_mesh():
    source = "def decode():\n    g = dist.new_group(ranks=[0, 1])\n"
    assert group_makers(source, "parallel/vae.py") == [("parallel/vae.py", "decode:new_group", 2)]


@pytest.mark.parametrize(
    ("replicas", "cfg", "sp", "dims", "replica"),
    [
        (1, 2, 4, {"cfg": 2, "sp": 4}, "cfg_sp"),
        (2, 2, 2, {"replica": 2, "cfg": 2, "sp": 2}, "cfg_sp"),
        (4, 2, 1, {"replica": 4, "cfg": 2}, "cfg"),
        (2, 1, 4, {"replica": 2, "sp": 4}, "sp"),
        (8, 1, 1, {"replica": 8}, None),
    ],
)
def test_mesh_dims(replicas, cfg, sp, dims, replica):
    layout = ParallelLayout(world_size=replicas * cfg * sp, sp_size=sp, cfg_degree=cfg, replicas=replicas)
    assert mesh_dims(layout) == dims and math.prod(dims.values()) == layout.world_size
    assert replica_dim(layout) == replica


# --- the groups of every layout of 8 ranks, launched ----------------------------------------------------------------
LAYOUTS = [[2, 2, 2], [1, 2, 4], [4, 2, 1], [2, 1, 4], [4, 1, 2], [1, 1, 8], [8, 1, 1]]  # replicas, cfg, sp
LAYOUTS += [[2, 1, 4, 2], [1, 2, 4, 2], [1, 2, 4, 4], [1, 1, 8, 2]]  # USP: ..., ring_size (ulysses = sp / ring)
WORLD = 8


def _argv(folder: Path, environ: dict[str, str]) -> list[str]:
    return [str(SCRIPT), str(folder), json.dumps(LAYOUTS)]


# a launch's script whose outcome is all the tests check: in the background, in turn with other modules' scripts of
# 8 ranks (launch_groups.py)
LAUNCH = torchrun_case("the mesh groups of 8 ranks", WORLD, _argv, timeout=300)
BACKGROUND_JOBS = {"launched": LAUNCH.hooks}


@pytest.fixture(scope="module")
def launched() -> list[list[dict]]:
    out, proc = LAUNCH.result()
    assert proc.returncode == 0, format_output(proc)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _mine(all_ranks: list[list[int]], rank: int) -> list[int]:
    (ranks,) = [r for r in all_ranks if rank in r]
    return ranks


def _check(group: dict | None, ranks: list[int] | None) -> None:
    if ranks is None:
        assert group is None
        return
    assert group is not None and group["ranks"] == ranks, (group, ranks)
    assert group["sum"] == sum(ranks), "the all-reduce reached ranks outside the group"
    assert group["timeout"] == 77.0, "dist_timeout must reach every group"


def _usp_group_ranks(layout: ParallelLayout) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups): within an sp group, contiguous runs of ulysses_size ranks, and the ranks of one
    ulysses_rank (ulysses_size apart)."""
    u = layout.ulysses_size
    ulysses = [sp[i : i + u] for sp in layout.sp_group_ranks() for i in range(0, len(sp), u)]
    ring = [sp[j::u] for sp in layout.sp_group_ranks() for j in range(u)]
    return ulysses, ring


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.parametrize(
    "index", range(len(LAYOUTS)), ids=["r{}xcfg{}xsp{}".format(*x) + (f"xring{x[3]}" if x[3:] else "") for x in LAYOUTS]
)
def test_the_mesh_groups_of_each_layout(launched, index):
    replicas, cfg, sp, *ring = LAYOUTS[index]
    layout = ParallelLayout(
        world_size=WORLD, sp_size=sp, cfg_degree=cfg, replicas=replicas, ring_size=ring[0] if ring else 1
    )
    for rank in range(WORLD):
        seen = launched[rank][index]
        assert seen["layout"] == LAYOUTS[index]
        dims = mesh_dims(layout)
        assert seen["dims"] == list(dims)
        # the mesh's grid is the layout's rank order: rank = (replica * cfg + cfg_rank) * sp + sp_rank
        expected_grid = list(range(WORLD))
        for size in reversed(list(dims.values())[1:]):
            expected_grid = [expected_grid[i : i + size] for i in range(0, len(expected_grid), size)]
        assert seen["grid"] == expected_grid
        groups = seen["groups"]
        _check(groups["sp"], _mine(layout.sp_group_ranks(), rank) if layout.sp_enabled else None)
        _check(groups["cfg"], _mine(layout.cfg_group_ranks(), rank) if layout.cfg_enabled else None)
        ulysses, ring_groups = _usp_group_ranks(layout)
        _check(groups["ulysses"], _mine(ulysses, rank) if layout.ulysses_size > 1 else None)
        _check(groups["ring"], _mine(ring_groups, rank) if layout.ring_enabled else None)
        replica = _mine(layout.replica_group_ranks(), rank) if layout.replica_size > 1 else None
        _check(groups["replica"], replica)
        _check(groups["replica_cpu"], replica)
        base = layout.output_ranks()[layout.replica(rank)]
        for size in range(2, layout.replica_size + 1):  # the decode's bands: the replica's first `size` ranks
            prefix = list(range(base, base + size))
            _check(seen["prefix"][str(size)], prefix if rank in prefix else None)
