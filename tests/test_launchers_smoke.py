"""Smoke tests of the launcher harness: CPU ranks under torchrun, srun (the local two-node Slurm), Open MPI's mpirun
and MPICH's mpiexec, each doing a real gloo all_reduce; and the harness's timeout killing every rank."""

from __future__ import annotations

import re
import textwrap

import pytest

from launchers import (
    SLURM_NODES,
    LauncherTimeout,
    format_output,
    local_slurm,  # noqa: F401  (a fixture: importing it registers it in this module)
    run_launcher,
)
from processes import wait_gone

# Reads the launcher's own variables, rendezvous through the launcher's store (torchrun) or a file on the shared
# filesystem (no port to pick), and all-reduces the ranks.
PROGRAM = textwrap.dedent(
    """
    import datetime
    import os
    import socket
    import sys

    import torch
    import torch.distributed as dist

    launcher, rendezvous_file = sys.argv[1], sys.argv[2]
    init_method = f"file://{rendezvous_file}"
    node = os.environ.get("SLURMD_NODENAME", "-")
    if launcher == "torchrun":
        rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        init_method = "env://"
    elif launcher == "srun":
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        local = int(os.environ["SLURM_LOCALID"])
    elif launcher == "mpirun":
        rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        local = int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    elif launcher == "mpich":
        rank, world, local = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"]), int(os.environ["MPI_LOCALRANKID"])
    else:
        raise SystemExit(f"unknown launcher {launcher}")

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    line = f"RANK {rank} WORLD {world} LOCAL {local} NODE {node} SUM {int(t.item())} EXTRA {os.environ.get('DISTVIDEO_SMOKE', '-')}"
    os.write(1, (line + "\\n").encode())  # one write per line: the ranks share the launcher's stdout
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _check(proc, expected_lines: list[str]) -> None:
    assert proc.returncode == 0, format_output(proc)
    # Anchored: each rank's line must arrive whole (see PYTHONUNBUFFERED in launchers.py).
    lines = sorted(re.findall(r"^RANK \d+ .*$", proc.stdout, flags=re.M))
    assert lines == sorted(expected_lines), format_output(proc)


def _one_node(launcher: str, nproc: int = 2) -> list[str]:
    total = nproc * (nproc - 1) // 2
    return [f"RANK {r} WORLD {nproc} LOCAL {r} NODE - SUM {total} EXTRA yes" for r in range(nproc)]


LAUNCHERS = [
    pytest.param("torchrun", id="torchrun"),
    pytest.param("mpirun", id="mpirun", marks=pytest.mark.mpi),
    pytest.param("mpich", id="mpich", marks=pytest.mark.mpi),
]


@pytest.mark.launcher
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_ranks_on_one_host(tmp_path, launcher):
    script = tmp_path / "allreduce.py"
    script.write_text(PROGRAM)
    argv = [str(script), launcher, str(tmp_path / "rendezvous")]
    proc = run_launcher(launcher, argv, nproc=2, env={"DISTVIDEO_SMOKE": "yes"}, timeout=120)
    _check(proc, _one_node(launcher))


@pytest.mark.launcher
@pytest.mark.slurm
@pytest.mark.usefixtures("local_slurm")
def test_srun_four_ranks_on_two_emulated_nodes(tmp_path):
    """srun -N 2 --ntasks-per-node=2: ranks 0-1 on the first node, 2-3 on the second, local ranks 0-1 on each."""
    script = tmp_path / "allreduce.py"
    script.write_text(PROGRAM)
    argv = [str(script), "srun", str(tmp_path / "rendezvous")]
    proc = run_launcher("srun", argv, nproc=4, nodes=2, env={"DISTVIDEO_SMOKE": "yes"}, timeout=120)
    expected = [f"RANK {r} WORLD 4 LOCAL {r % 2} NODE {SLURM_NODES[r // 2]} SUM 6 EXTRA yes" for r in range(4)]
    _check(proc, expected)


# Every rank records its pid, then hangs.
HANG = textwrap.dedent(
    """
    import os
    import pathlib
    import sys
    import time

    pathlib.Path(sys.argv[1], str(os.getpid())).write_text("")
    print("hanging", os.getpid(), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.launcher
@pytest.mark.parametrize(
    "launcher",
    [
        "torchrun",
        pytest.param("srun", marks=pytest.mark.slurm),
        pytest.param("mpirun", marks=pytest.mark.mpi),
        pytest.param("mpich", marks=pytest.mark.mpi),
    ],
)
def test_timeout_kills_every_rank(tmp_path, launcher):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()

    def both_ranks_up() -> bool:
        return len(list(pids_dir.iterdir())) == 2

    with pytest.raises(LauncherTimeout, match="timed out after"):
        # the 1 s counts from the moment both ranks are up (however long starting them takes on a loaded machine)
        run_launcher(launcher, [str(script), str(pids_dir)], nproc=2, timeout=1, timeout_from=both_ranks_up)
    pids = [int(p.name) for p in pids_dir.iterdir()]
    assert len(pids) == 2, pids
    assert wait_gone(pids, within=30) == [], f"{launcher} ranks survived the timeout: {pids}"
