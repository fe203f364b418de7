"""Frames recorded before the code was restructured (issue 13): the restructuring must not change a single value.

`tests/data/frames_before_restructure.npz` holds the frames of one guided request on the 4-layer test checkpoint,
inline and under the mp executor with sp=2, as returned by the API at commit 1d359f3 (torch 2.13.0 CPU, MKL_CBWR
AUTO,STRICT as distvideo now sets it), once for each kind of machine it was recorded on, keyed by that machine's
numerics fingerprint (`{fingerprint}_inline`, `{fingerprint}_mp_sp2`).

Float rounding depends on the CPU's kernels (AVX2, AVX-512 or AMX code paths in MKL, oneDNN and ATen): the same code
gives frames that differ by 1 in a few uint8 values on an AMD EPYC (AVX2) and on an Intel Xeon (AVX-512, AMX). So the
frames are compared exactly on a machine of a recorded kind (same fingerprint), and within the parity tolerance (max
abs difference 2) of every recording elsewhere.

What it guards: a restructuring that promises to keep every frame (issue 13's, the executors' and process groups'
reshaping after it) keeps them bit for bit, checked against the code of before it rather than against itself; the
diffusers parity tests only bound the frames within 2. `scripts/record_frames.py` makes the recording from commit
1d359f3's code in a git worktree: `--check` records again and compares with the stored frames (identical on the
kind of machine that recorded it, bbd577a915692ab3, on 2026-12-03), without `--check` it adds a machine kind not
recorded yet (docs/determinism.md).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distvideo import VideoGenerator
from launch_groups import torchrun_case

RECORDED = Path(__file__).parent / "data" / "frames_before_restructure.npz"
PROMPT = "a lighthouse in a storm"
REQUEST = dict(num_frames=9, height=48, width=80, num_inference_steps=4, guidance_scale=5.0, seed=11, save_video=False)
PARITY = 2  # max abs difference on uint8 between machines whose kernels round differently


def numerics_fingerprint() -> str:
    """A hash of the bits of the float operations the pipeline is made of, on fixed inputs: equal on machines whose
    kernels round alike (thread count does not matter: distvideo makes MKL's products reproducible)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    x, q, k, v = randn(7, 32), randn(1, 4, 24, 8), randn(1, 4, 9, 8), randn(1, 4, 9, 8)
    video, kernel = randn(1, 8, 3, 10, 12), randn(8, 8, 3, 3, 3)
    outputs = [
        F.linear(x, randn(32, 32), randn(32)),
        F.linear(randn(512, 64), randn(128, 64)),
        torch.einsum("bhsd,bhtd->bhst", q, k).softmax(-1),
        F.scaled_dot_product_attention(q, k, v),
        F.conv3d(video, kernel, padding=1),
        torch.ops.aten.mkldnn_convolution(video, kernel, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1),
        F.layer_norm(x, (32,)),
        F.gelu(x, approximate="tanh"),
        F.silu(x),
        torch.exp(x) + torch.sin(x) * torch.cos(x),
        (x * x).sum(-1, keepdim=True).rsqrt(),
    ]
    digest = hashlib.sha256()
    for out in outputs:
        digest.update(out.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def recorded() -> dict[str, np.ndarray]:
    with np.load(RECORDED) as data:
        return {name: data[name] for name in data.files}


def assert_recorded(frames: np.ndarray, recorded: dict[str, np.ndarray], name: str) -> None:
    recordings = {key.rsplit("_" + name, 1)[0]: value for key, value in recorded.items() if key.endswith("_" + name)}
    assert recordings, f"no recording of {name} in {RECORDED}"
    here = numerics_fingerprint()
    if here in recordings:
        expected = recordings[here]
        assert frames.shape == expected.shape and frames.dtype == expected.dtype
        assert np.array_equal(frames, expected), f"{name}: frames changed on the kernels of machine kind {here}"
        return
    for fingerprint, expected in recordings.items():  # another kind of CPU: its kernels round differently
        assert frames.shape == expected.shape and frames.dtype == expected.dtype
        diff = np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max()
        assert diff <= PARITY, f"{name}: max abs difference {diff} from the recording of machine kind {fingerprint}"


def test_the_recordings_of_two_machine_kinds_differ_within_the_tolerance(recorded):
    """The recordings are of different kernels (else one of them is redundant) and agree within the tolerance."""
    for name in ("inline", "mp_sp2"):
        frames = [value for key, value in sorted(recorded.items()) if key.endswith("_" + name)]
        assert len(frames) >= 2
        diffs = [np.abs(a.astype(np.int16) - frames[0].astype(np.int16)).max() for a in frames[1:]]
        assert all(0 < diff <= PARITY for diff in diffs), diffs


def fingerprint_in_a_new_process(threads: int) -> str:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import distvideo, test_frames_recorded as t; "
        "print(t.numerics_fingerprint())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("MKL_CBWR", None)  # what importing distvideo chooses
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_kernels_round_alike_whatever_the_thread_count():
    """Importing distvideo makes MKL's products independent of the thread count (envs.MKL_REPRODUCIBLE): without
    it, a product of a few rows (the compacted text of a short prompt) rounds differently with 1 thread than with 2,
    and 2 replicas of 1 thread each wrote other bytes than one inline rank with 2 threads."""
    one, two = fingerprint_in_a_new_process(1), fingerprint_in_a_new_process(2)
    assert one == two == numerics_fingerprint()


def test_inline_frames_are_the_recorded_ones(test_checkpoint, recorded):
    with VideoGenerator.from_pretrained(test_checkpoint, executor="inline") as gen:
        frames = gen.generate(PROMPT, **REQUEST).frames
    assert_recorded(frames, recorded, "inline")


@pytest.mark.slow
def test_sequence_parallel_frames_are_the_recorded_ones(test_checkpoint, recorded):
    with VideoGenerator.from_pretrained(
        test_checkpoint, executor="mp", num_gpus=2, cfg_parallel=False, sp_size=2
    ) as gen:
        frames = gen.generate(PROMPT, **REQUEST).frames
    assert_recorded(frames, recorded, "mp_sp2")


RESHAPING = Path(__file__).parent / "data" / "frames_before_reshaping.npz"


def _layouts_argv(folder: Path, environ: dict[str, str]) -> list[str]:
    """The torchrun launch's script, on a copy of the session's test checkpoint built in a process of its own."""
    from background import BUILD_CHECKPOINT, run_python

    run_python(BUILD_CHECKPOINT, [str(folder / "ckpt")], environ)
    (folder / "out").mkdir()
    script = Path(__file__).parent / "rank_scripts" / "recorded_layouts.py"
    return [str(script), str(folder / "ckpt"), str(folder / "out")]


# a launch whose outcome is all the test checks: in the background, in turn with other modules' scripts
# (launch_groups.py)
LAYOUTS = torchrun_case("the recorded layouts under torchrun", 2, _layouts_argv, timeout=300)
BACKGROUND_JOBS = {"launched_layouts": LAYOUTS.hooks}


launched_layouts = LAYOUTS.fixture("launched_layouts")


@pytest.mark.launcher
@pytest.mark.slow
def test_launched_layouts_give_the_recorded_frames_and_videos(launched_layouts):
    """Issue 27's reshaping (one primitive per executor, groups from a device mesh, named plans) keeps every frame
    and every video byte of the external executor's 2-rank layouts: sp=2, cfg=2, and two items over 2 replicas, each
    as commit 0de9300's code gave them (scripts/record_frames.py --set reshaping). Video bytes are compared on a
    machine of a recorded kind only: elsewhere the frames differ within the tolerance, and so do the files."""
    from rank_scripts.recorded_layouts import read_outputs

    from launchers import format_output

    folder, proc = launched_layouts
    assert proc.returncode == 0, format_output(proc)
    launched = read_outputs(folder / "out")
    with np.load(RESHAPING) as data:
        recorded = {name: data[name] for name in data.files}
    names = sorted({key.split("_", 1)[1] for key in recorded if not key.endswith("_video")})
    assert sorted(name for name in launched if not name.endswith("_video")) == names
    kind = numerics_fingerprint()
    for name in names:
        assert_recorded(launched[name], recorded, name)
        if f"{kind}_{name}_video" in recorded:
            assert str(launched[f"{name}_video"]) == str(recorded[f"{kind}_{name}_video"]), f"{name}: video bytes"
