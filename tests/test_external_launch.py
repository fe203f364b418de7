"""The external-launcher executor under real torchrun, srun and mpirun (CPU, gloo, 2 ranks).

Each launcher runs (1) the `distvideo generate` command, which must write exactly one video, byte-identical
to the single-process run's, and (2) a script exercising the API: output only on rank 0, a failure
planted on rank 1 raising the same error on both ranks, divergent prompts refused on every rank.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from distvideo import VideoGenerator
from distvideo.cli.main import main

from conftest import REPO, max_abs_diff
from launchers import format_output, local_slurm, run_launcher  # noqa: F401

pytestmark = [pytest.mark.launcher]

LAUNCH_PARAMS = [
    pytest.param("torchrun", id="torchrun"),
    pytest.param("srun", id="srun", marks=pytest.mark.slurm),
    pytest.param("mpirun", id="mpirun", marks=pytest.mark.mpi),
]
SMALL = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2", "--seed", "5"]
REQUEST = dict(num_frames=5, height=32, width=48, num_inference_steps=2, seed=5)


@pytest.fixture(scope="module")
def single_process_frames():
    with VideoGenerator.from_pretrained(executor="inline") as gen:
        return gen.generate("a red fox", save_video=False, **REQUEST).frames


@pytest.fixture(scope="module")
def single_process_video(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("single") / "video.mp4"
    assert main(["generate", "--prompt", "a red fox", "--output", str(out), "--executor", "inline", *SMALL]) == 0
    return out.read_bytes()


@pytest.mark.parametrize("launcher", LAUNCH_PARAMS)
def test_generate_command_writes_one_video_equal_to_single_process(launcher, tmp_path, single_process_video):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = ["-m", "distvideo", "generate", "--prompt", "a red fox", "--output", str(out_dir / "v.mp4"), *SMALL]
    proc = run_launcher(launcher, argv, nproc=2, timeout=300)
    assert proc.returncode == 0, format_output(proc)
    assert sorted(p.name for p in out_dir.iterdir()) == ["v.mp4"], "exactly one video, written by rank 0"
    assert proc.stdout.split().count(str(out_dir / "v.mp4")) == 1, "only rank 0 prints the path"
    # 2 ranks split only the CFG branches here (bit-exact), and the encoder is deterministic: the very same file
    assert (out_dir / "v.mp4").read_bytes() == single_process_video


@pytest.mark.parametrize("launcher", LAUNCH_PARAMS)
def test_api_under_launcher(launcher, tmp_path, single_process_frames):
    script = REPO / "tests" / "rank_scripts" / "external_api.py"
    proc = run_launcher(launcher, [str(script), str(tmp_path)], nproc=2, timeout=300)
    assert proc.returncode == 0, format_output(proc)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    expected_launcher = {"torchrun": "torchrun", "srun": "slurm", "mpirun": "mpi"}[launcher]
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
    assert "num_gpus=3" in proc.stderr and "started 2 processes" in proc.stderr
    assert list(tmp_path.iterdir()) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
