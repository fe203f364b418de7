"""The launcher harness's timeout kills every rank under torchrun, srun (the local two-node Slurm), Open MPI's mpirun
and MPICH's mpiexec. (That each launcher starts its ranks with their variables and the environment given is what
every launched test relies on: tests/test_external_launch.py reads them on every launcher, two Slurm nodes included.)"""

from __future__ import annotations

import textwrap

import pytest

from launchers import (
    LauncherTimeout,
    local_slurm,  # noqa: F401  (a fixture: importing it registers it in this module)
    run_launcher,
)
from processes import wait_gone

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
