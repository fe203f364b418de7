"""The external-launcher executor under real torchrun, srun and mpirun (CPU, gloo, 2 ranks).

Each launcher (torchrun, srun, Open MPI's and MPICH's mpirun) runs one 2-rank launch in which every rank runs (1) the
`distvideo generate` command in-process, which must write exactly one video, byte-identical to the mp executor's on
the same 2-rank layout, then (2) a script exercising the API: output only on rank 0, frames within 2 of the
single-process run's, a failure planted on rank 1 raising the same error on both ranks, divergent prompts refused on
every rank, the thread policy; and no gloo thread may be alive when its ranks' interpreters exit.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch.distributed

from distvideo import VideoGenerator
from distvideo.cli.main import main
from distvideo.media import write_video

from background import FolderJob
from conftest import REPO, max_abs_diff
from launchers import SLURM_NODES, format_output, local_slurm, run_launcher  # noqa: F401

pytestmark = [pytest.mark.launcher]

LAUNCH_PARAMS = [
    pytest.param("torchrun", id="torchrun"),
    pytest.param("srun", id="srun", marks=pytest.mark.slurm),
    pytest.param("mpirun", id="mpirun", marks=pytest.mark.mpi),
]
# MPICH's mpiexec (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID), installed beside Open MPI: the API script only
API_PARAMS = [*LAUNCH_PARAMS, pytest.param("mpich", id="mpich", marks=pytest.mark.mpi)]
SMALL = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2", "--seed", "5"]
REQUEST = dict(num_frames=5, height=32, width=48, num_inference_steps=2, seed=5)


@pytest.fixture(scope="module")
def single_process_frames():
    with VideoGenerator.from_pretrained(executor="inline") as gen:
        return gen.generate("a red fox", save_video=False, **REQUEST).frames


@pytest.fixture(scope="module")
def mp_video(tmp_path_factory) -> bytes:
    """The video of the same command on the mp executor with 2 ranks: the layout 2 launched ranks take (cfg=2)."""
    out = tmp_path_factory.mktemp("mp") / "video.mp4"
    argv = ["generate", "--prompt", "a red fox", "--output", str(out), "--executor", "mp", "--num-gpus", "2", *SMALL]
    assert main(argv) == 0
    return out.read_bytes()


# Imported at start-up by every Python process whose PYTHONPATH starts with its folder: at interpreter exit (atexit
# runs before finalization), a process that ran distvideo's worker writes the names of its OS threads.
EXIT_THREADS_PROBE = """
import atexit, json, os, sys

def _report():
    if "distvideo.worker" not in sys.modules:  # the launcher's own Python process (torchrun's agent)
        return
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    with open(os.path.join(os.environ["DISTVIDEO_TEST_EXIT_THREADS"], f"{os.getpid()}.json"), "w") as f:
        json.dump(names, f)

atexit.register(_report)
"""


def gloo_thread_names() -> list[str]:
    """This process's OS threads that belong to gloo (named by torch: pt_gloo_runloop, gloo_tcp_loop)."""
    names = [Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)


def exit_threads_probe(folder: Path, base: Mapping[str, str]) -> dict[str, str]:
    """The environment that makes launched ranks report their threads at exit into `folder` (one JSON per process)."""
    (folder / "site").mkdir(parents=True)
    (folder / "site" / "sitecustomize.py").write_text(textwrap.dedent(EXIT_THREADS_PROBE))
    (folder / "reports").mkdir()
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder / "site"), base.get("PYTHONPATH")])),
        "DISTVIDEO_TEST_EXIT_THREADS": str(folder / "reports"),
    }


def _launch_api(launcher: str, tmp: Path, environ: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Every rank runs the `generate` command in-process, then the API script (rank_scripts/external_api.py), with
    OMP_NUM_THREADS unset (the user's shell must not decide the thread policy) and the exit-threads probe."""
    base = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in THREAD_VARIABLES}
    (tmp / "api").mkdir()
    (tmp / "cli").mkdir()
    argv = [str(REPO / "tests" / "rank_scripts" / "external_api.py"), str(tmp / "api"), str(tmp / "cli/v.mp4")]
    env = exit_threads_probe(tmp / "probe", base)
    return run_launcher(launcher, argv, nproc=2, env=env, timeout=300, base=base)


THREAD_VARIABLES = ("OMP_NUM_THREADS", "DISTVIDEO_NUM_THREADS")
# one 2-rank launch per launcher serves both tests below; torchrun's and the MPIs' run in the background
# (background.py), srun's in the test (a job never uses the session's Slurm)
API_LAUNCHES = {
    launcher: FolderJob(
        f"external API under {launcher}", f"external-{launcher}", functools.partial(_launch_api, launcher)
    )
    for launcher in ("torchrun", "mpirun", "mpich")
}
BACKGROUND_JOBS = {f"launch[{launcher}]": job.hooks for launcher, job in API_LAUNCHES.items()}


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Callable[[str], tuple[Path, subprocess.CompletedProcess]]:
    done: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def run(launcher: str) -> tuple[Path, subprocess.CompletedProcess]:
        if launcher in API_LAUNCHES:
            return API_LAUNCHES[launcher].result()
        if launcher not in done:
            tmp = tmp_path_factory.mktemp(f"launch-{launcher}")
            done[launcher] = (tmp, _launch_api(launcher, tmp))
        return done[launcher]

    return run


@pytest.mark.parametrize("launcher", API_PARAMS)
def test_generate_command_writes_one_video_equal_to_the_mp_executors(launcher, launch, mp_video):
    """Also: no gloo thread is alive when a rank's interpreter exits. A process group that outlived
    VideoGenerator.shutdown() has its worker threads running into interpreter finalization, where one still freeing
    its last collective's tensors (that takes the GIL) is ended by CPython and aborts the rank: "terminate called
    without an active exception", exit -6 after a successful run (issue 26). That abort is a race; a group alive at
    exit is not."""
    # the names looked for below are the ones this torch gives gloo's threads: a live one-rank group has them
    group = torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    # each of its threads names itself once it runs, which on a loaded machine can be a while after the constructor
    deadline = time.monotonic() + 60
    while not gloo_thread_names() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gloo_thread_names(), "a live gloo group shows no thread named *gloo*: update gloo_thread_names()"
    del group
    tmp, proc = launch(launcher)
    assert proc.returncode == 0, format_output(proc)
    assert [json.loads((tmp / "api" / f"rank{r}.json").read_text())["cli_exit"] for r in (0, 1)] == [0, 0]
    reports = [json.loads(p.read_text()) for p in sorted((tmp / "probe" / "reports").iterdir())]
    assert len(reports) == 2, f"one exit report per rank, got {len(reports)}\n{format_output(proc)}"
    left = [sorted(n for n in names if "gloo" in n) for names in reports]
    assert left == [[], []], f"gloo threads alive at interpreter exit (a process group outlived shutdown): {left}"
    assert sorted(p.name for p in (tmp / "cli").iterdir()) == ["v.mp4"], "exactly one video, written by rank 0"
    assert proc.stdout.split().count(str(tmp / "cli" / "v.mp4")) == 1, "only rank 0 prints the path"
    # the same layout (cfg=2) on another executor gives the same frames bit for bit, and the encoder is
    # deterministic: the very same file. (One rank is another layout: its frames are within 2, test_api_under_launcher.)
    assert (tmp / "cli" / "v.mp4").read_bytes() == mp_video


@pytest.mark.parametrize("launcher", API_PARAMS)
def test_api_under_launcher(launcher, launch, single_process_frames):
    """Also the thread policy with 2 ranks on a node and OMP_NUM_THREADS unset: cores / 2 threads per rank.
    torchrun hands the ranks OMP_NUM_THREADS=1 of its own, which does not count as the user's (on a 2-core machine
    both give 1, so torchrun's case tells them apart only on bigger machines; mpirun's does here: under Open MPI
    torch alone runs 1 thread)."""
    tmp, proc = launch(launcher)
    assert proc.returncode == 0, format_output(proc)
    tmp_path = tmp / "api"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    expected_launcher = {"torchrun": "torchrun", "srun": "slurm", "mpirun": "mpi", "mpich": "mpi"}[launcher]
    for rank, rep in enumerate((r0, r1)):
        assert rep["executor"] == "ExternalExecutor" and rep["world_size"] == 2
        assert rep["launcher"] == expected_launcher
        assert rep["is_output_rank"] == (rank == 0)
        assert [r[:2] for r in rep["ranks"]] == [[0, 2], [1, 2]]
        assert rep["ping_after_failure"] == [0, 1] and rep["ping_at_end"] == [0, 1]
        assert "dist_timeout" in rep["timeout"]
    # one process per rank, no extra processes
    assert r0["ranks"][0][2] != r0["ranks"][1][2]
    # output belongs to rank 0
    assert r0["video_path"] == str(tmp_path / "video.mp4") and r0["has_frames"]
    assert r1["video_path"] is None and not r1["has_frames"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames.npy", "rank0.json", "rank1.json", "video.mp4"]
    assert max_abs_diff(np.load(tmp_path / "frames.npy"), single_process_frames) <= 2
    # the same error on both ranks, naming rank 1 only
    assert r0["failure"] == r1["failure"]
    assert "rank 1: ValueError: planted failure on rank 1" in r0["failure"] and "rank 0:" not in r0["failure"]
    # divergent prompts refused on every rank, naming the field
    assert r0["divergence"] == r1["divergence"] and r0["divergence"] is not None
    assert "prompt" in r0["divergence"] and "prompt of rank 1" in r0["divergence"]
    if launcher in ("torchrun", "mpirun"):
        for rep in (r0, r1):
            threads = rep["threads"]
            assert threads["given_omp"] == ("1" if launcher == "torchrun" else None), threads
            assert threads["torch"] == max(1, threads["cores"] // 2), threads


@pytest.mark.usefixtures("no_weights_loaded")
def test_external_without_launcher_is_a_config_error(capsys):
    code = main(["generate", "--prompt", "x", "--executor", "external", *SMALL])
    assert code == 2
    err = capsys.readouterr().err
    assert "RANK" in err and "torchrun" in err


@pytest.mark.parametrize("launcher", [pytest.param("torchrun", id="torchrun")])
def test_num_gpus_mismatch_is_refused(launcher, tmp_path):
    argv = ["-m", "distvideo", "generate", "--prompt", "x", "--num-gpus", "3", "--output", str(tmp_path), *SMALL]
    proc = run_launcher(launcher, argv, nproc=2, timeout=300)
    assert proc.returncode != 0
    assert "--num-gpus 3 but" in proc.stderr and "started 2 processes; give --num-gpus 2" in proc.stderr
    assert list(tmp_path.iterdir()) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# --- the documented Slurm path, and threads per rank ------------------------------------------------------------------
LAUNCH_REPORT = REPO / "tests" / "rank_scripts" / "launch_report.py"


def rank_reports(out, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slurm
def test_srun_on_two_nodes_derives_the_rendezvous_from_the_node_list(tmp_path, single_process_frames):
    """`srun -N 2 --ntasks-per-node=2` on the local two-node Slurm, with no MASTER_ADDR/MASTER_PORT anywhere: every rank
    derives the rendezvous from the node list (the first node) and the job id (20000 + id % 12000, docs/launching.md),
    the four ranks form one job, rank 0 alone writes the one video, and the frames are one rank's within 2 (4 ranks run
    cfg=2 x sp=2, another layout)."""
    proc = run_launcher("srun", [str(LAUNCH_REPORT), str(tmp_path), "generate"], nproc=4, nodes=2, timeout=300)
    assert proc.returncode == 0, format_output(proc)
    reports = rank_reports(tmp_path, 4)
    job_id = int(reports[0]["job_id"])
    for rank, report in enumerate(reports):
        assert report["given"]["MASTER_ADDR"] is None and report["given"]["MASTER_PORT"] is None, report
        assert report["launcher"] == "slurm" and report["world_size"] == 4 and report["rank"] == rank
        assert report["node"] == SLURM_NODES[rank // 2] and report["local_rank"] == rank % 2, report
        assert report["local_world_size"] == 2
        assert report["master_addr"] == SLURM_NODES[0] and report["master_port"] == 20000 + job_id % 12000
        assert report["video_path"] == (str(tmp_path / "video.mp4") if rank == 0 else None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "frames.npy",
        *(f"rank{r}.json" for r in range(4)),
        "video.mp4",
    ]
    frames = np.load(tmp_path / "frames.npy")
    assert frames.std() > 1.0 and max_abs_diff(frames, single_process_frames) <= 2
    # the video holds exactly those frames: the encoder is deterministic, so re-encoding them gives the same bytes
    assert (tmp_path / "video.mp4").read_bytes() == write_video(frames, tmp_path / "again" / "v.mp4").read_bytes()


THREAD_CASES = [
    # launcher, ranks, OMP_NUM_THREADS set by the user (None: unset), expected threads per rank from the cores
    # (2 ranks per node, torchrun's and mpirun's: read from test_api_under_launcher's launches)
    # under Open MPI torch alone runs 1 thread (MKL's default under MPI): the policy gives the rank every core
    pytest.param("mpirun", 1, None, lambda cores: cores, id="mpirun-1-rank", marks=pytest.mark.mpi),
    # the user's OMP_NUM_THREADS wins over cores / ranks
    pytest.param("mpirun", 1, "1", lambda cores: 1, id="mpirun-1-rank-user-omp-1", marks=pytest.mark.mpi),
]


def _launch_report(launcher: str, ranks: int, omp: str | None, folder: Path, environ: Mapping[str, str]):
    base = {k: v for k, v in environ.items() if k not in THREAD_VARIABLES}  # the user's shell must not decide the case
    env = {"OMP_NUM_THREADS": omp} if omp is not None else {}
    return run_launcher(launcher, [str(LAUNCH_REPORT), str(folder)], nproc=ranks, env=env, timeout=300, base=base)


# whole launches whose reports are all the test checks: in the background (background.py)
THREAD_LAUNCHES = {
    case.id: FolderJob(f"threads per rank, {case.id}", "threads", functools.partial(_launch_report, *case.values[:3]))
    for case in THREAD_CASES
}
BACKGROUND_JOBS["threads_launch"] = (
    lambda: [job.start() for job in THREAD_LAUNCHES.values()],
    lambda: [job.stop() for job in THREAD_LAUNCHES.values()],
)


@pytest.fixture
def threads_launch(request) -> tuple[Path, subprocess.CompletedProcess]:
    return THREAD_LAUNCHES[request.node.callspec.id].result()


@pytest.mark.parametrize(("launcher", "ranks", "omp", "expected"), THREAD_CASES)
def test_threads_per_rank(launcher, ranks, omp, expected, threads_launch):
    """Each rank runs about cores on the node / ranks on the node intra-op threads, unless the user set
    OMP_NUM_THREADS (2 ranks per node, and torchrun's own OMP_NUM_THREADS=1: test_api_under_launcher)."""
    folder, proc = threads_launch
    assert proc.returncode == 0, format_output(proc)
    for report in rank_reports(folder, ranks):
        assert report["threads"] == expected(report["cores"]), report
