"""Smoke tests of the launcher harness: 2 CPU ranks under torchrun, srun (local Slurm) and mpirun, each doing
a real gloo all_reduce."""

from __future__ import annotations

import re
import textwrap
import time

import psutil
import pytest

from launchers import (
    LauncherTimeout,
    format_output,
    local_slurm,  # noqa: F401  (a fixture: importing it registers it in this module)
    run_launcher,
)

# Reads the launcher's own variables, rendezvous over TCP on 127.0.0.1 and all-reduces the ranks.
PROGRAM = textwrap.dedent(
    """
    import datetime
    import os
    import sys

    import torch
    import torch.distributed as dist

    launcher = sys.argv[1]
    if launcher == "torchrun":
        rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        init_method = "env://"
    elif launcher == "srun":
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        local = int(os.environ["SLURM_LOCALID"])
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    elif launcher == "mpirun":
        rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        local = int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    else:
        raise SystemExit(f"unknown launcher {launcher}")

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    line = f"RANK {rank} WORLD {world} LOCAL {local} SUM {int(t.item())} EXTRA {os.environ.get('DISTVIDEO_SMOKE', '-')}"
    os.write(1, (line + "\\n").encode())  # one write per line: the ranks share the launcher's stdout
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _check(proc, nproc: int = 2) -> None:
    assert proc.returncode == 0, format_output(proc)
    # Anchored: each rank's line must arrive whole (see PYTHONUNBUFFERED in launchers.py).
    lines = sorted(re.findall(r"^RANK \d+ .*$", proc.stdout, flags=re.M))
    expected_sum = sum(range(nproc))
    expected = sorted(f"RANK {r} WORLD {nproc} LOCAL {r} SUM {expected_sum} EXTRA yes" for r in range(nproc))
    assert lines == expected, format_output(proc)


@pytest.mark.launcher
def test_torchrun_two_ranks(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(PROGRAM)
    proc = run_launcher("torchrun", [str(script), "torchrun"], nproc=2, env={"DISTVIDEO_SMOKE": "yes"}, timeout=120)
    _check(proc)


@pytest.mark.launcher
@pytest.mark.slurm
@pytest.mark.usefixtures("local_slurm")
def test_srun_two_ranks(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(PROGRAM)
    proc = run_launcher("srun", [str(script), "srun"], nproc=2, env={"DISTVIDEO_SMOKE": "yes"}, timeout=120)
    _check(proc)


@pytest.mark.launcher
@pytest.mark.mpi
def test_mpirun_two_ranks(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(PROGRAM)
    proc = run_launcher("mpirun", [str(script), "mpirun"], nproc=2, env={"DISTVIDEO_SMOKE": "yes"}, timeout=120)
    _check(proc)


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


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.launcher
@pytest.mark.parametrize(
    "launcher",
    ["torchrun", pytest.param("srun", marks=pytest.mark.slurm), pytest.param("mpirun", marks=pytest.mark.mpi)],
)
def test_timeout_kills_every_rank(tmp_path, launcher):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    with pytest.raises(LauncherTimeout, match="timed out after"):
        # torchrun's agent imports torch (seconds on a busy 2-core machine) before it starts the ranks.
        run_launcher(launcher, [str(script), str(pids_dir)], nproc=2, timeout=15 if launcher == "torchrun" else 6)
    pids = [int(p.name) for p in pids_dir.iterdir()]
    assert len(pids) == 2, f"expected 2 ranks to have started within the timeout, got {pids}"
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)], f"{launcher} ranks survived the timeout: {pids}"
