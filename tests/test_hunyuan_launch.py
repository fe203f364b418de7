"""HunyuanVideo 1.5 under torchrun (2 CPU ranks, gloo, the external executor): Ulysses (sp=2) and CFG parallelism
(cfg=2), text- and image-to-video, reproduce the inline frames within 2, with the frames on rank 0 only, the declared
collectives, and the image condition computed on rank 0 and bit-identical on both ranks; the banded decode of the
HunyuanVideo 1.5 VAE equals a single-rank decode; the sp=2 frames are within 2 of diffusers' directly. One launch runs every engine (tests/parallel_scripts/family_cases.py,
shared with the Wan families); srun and mpirun run two of them (both tasks, both kinds of parallelism)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distvideo import VideoGenerator
from launch_groups import torchrun_case

from background import FolderJob, run_program
from conftest import REPO
from launchers import format_output, run_launcher

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

SCRIPT = REPO / "tests" / "parallel_scripts" / "family_cases.py"
PROMPT = "a red fox running through snow"  # the script's
LAYERS = 2
# 3 latent frames x 4 x 5 = 60 tokens; 4 latent rows: the decode runs in two bands of 2. The image-to-video size is
# the image's bucket (48 x 64: 3 latent rows, decoded on rank 0 alone)
T2V = dict(num_frames=9, height=64, width=80, num_inference_steps=2, guidance_scale=4.5, seed=7)
# the VAE decoded in bands against one rank on the same latents: 4 rows (2 + 2), 5 rows (3 + 2)
DECODE_CHECKS = [[1, 8, 3, 4, 5], [1, 8, 2, 5, 3]]
I2V = dict(num_frames=9, num_inference_steps=2, guidance_scale=4.5, seed=8)
ENGINES = [  # (engine, checkpoint, sp_size, cfg_parallel, request)
    ("t2v-sp2", "t2v", 2, False, T2V),
    ("t2v-cfg2", "t2v", 1, True, T2V),
    ("i2v-sp2", "i2v", 2, False, I2V),
    ("i2v-cfg2", "i2v", 1, True, I2V),
]


def build_checkpoints(root: Path) -> dict[str, Any]:
    from distvideo.testing.families import write_test_image
    from distvideo.testing.hunyuan import build_hunyuan_checkpoint

    return {
        "t2v": build_hunyuan_checkpoint(root / "t2v", seed=23),
        "i2v": build_hunyuan_checkpoint(root / "i2v", seed=24, image_to_video=True, target_size=64),
        "image": write_test_image(root / "image.png", width=40, height=28, seed=2),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return build_checkpoints(tmp_path_factory.mktemp("hv15-launch"))


def _kwargs(checkpoints: dict[str, Any], kind: str, request: dict[str, Any]) -> dict[str, Any]:
    return {**request, **({"image": str(checkpoints["image"])} if kind == "i2v" else {})}


def _argv(launcher: str, tmp: Path, checkpoints: dict[str, Any], engines: list[tuple]) -> list[str]:
    cases = [
        {
            "name": name,
            "model": str(checkpoints[kind]),
            "sp_size": sp,
            "cfg_parallel": cfg,
            "requests": [{"name": "r", "kwargs": _kwargs(checkpoints, kind, request)}],
            "decode_checks": DECODE_CHECKS if name == "t2v-sp2" and launcher == "torchrun" else [],
        }
        for name, kind, sp, cfg, request in engines
    ]
    (tmp / "cases.json").write_text(json.dumps(cases))
    return [str(SCRIPT), str(tmp / "cases.json"), str(tmp)]


def _outcome(tmp: Path, proc: subprocess.CompletedProcess) -> dict[str, Any]:
    assert proc.returncode == 0, format_output(proc)
    return {"dir": tmp, "report": json.loads((tmp / "report.json").read_text())}


def _run(launcher: str, tmp: Path, checkpoints: dict[str, Any], engines: list[tuple]) -> dict[str, Any]:
    proc = run_launcher(launcher, _argv(launcher, tmp, checkpoints, engines), nproc=2, timeout=600)
    return _outcome(tmp, proc)


def _built(folder: Path, environ: dict[str, str]) -> dict[str, Any]:
    """The module's checkpoints in FOLDER, built in a process of its own (the same bytes as the module's, which the
    single-rank frames come from); FOLDER/launch made for the launch's outputs."""
    code = "import sys, pathlib, test_hunyuan_launch as t; t.build_checkpoints(pathlib.Path(sys.argv[1]))"
    env = {**environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), environ.get("PYTHONPATH")]))}
    build = run_program([sys.executable, "-c", code, str(folder)], threading.Event(), 300, env=env)
    assert build.returncode == 0, build.stderr
    (folder / "launch").mkdir()
    return {"t2v": folder / "t2v", "i2v": folder / "i2v", "image": folder / "image.png"}


def _torchrun_argv(folder: Path, environ: dict[str, str]) -> list[str]:
    """The four engines under torchrun, on checkpoints of their own."""
    return _argv("torchrun", folder / "launch", _built(folder, environ), ENGINES)


#: what srun and mpirun run: Ulysses on text-to-video, CFG parallelism on image-to-video
OTHER_LAUNCHERS = [e for e in ENGINES if e[0] in ("t2v-sp2", "i2v-cfg2")]


def _mpirun_launch(folder: Path, environ: dict[str, str]) -> subprocess.CompletedProcess:
    argv = _argv("mpirun", folder / "launch", _built(folder, environ), OTHER_LAUNCHERS)
    return run_launcher("mpirun", argv, nproc=2, timeout=600, base=environ)


# a launch's script whose outcome is all the tests check: in the background, in turn with other modules' scripts of
# 2 ranks (launch_groups.py)
TORCHRUN = torchrun_case("HunyuanVideo 1.5 under torchrun", 2, _torchrun_argv, timeout=600)
# mpirun's too, in a launch of its own; srun's in the test (a job never uses the session's Slurm)
MPIRUN = FolderJob("HunyuanVideo 1.5 under mpirun", "hv15-mpirun", _mpirun_launch)
BACKGROUND_JOBS = {"launch": TORCHRUN.hooks, "launched[mpirun]": MPIRUN.hooks}


@pytest.fixture(scope="module")
def launch() -> dict[str, Any]:
    folder, proc = TORCHRUN.result()
    return _outcome(folder / "launch", proc)


@pytest.fixture(scope="module")
def inline(checkpoints: dict[str, Any]) -> dict[str, np.ndarray]:
    frames = {}
    for kind, request in (("t2v", T2V), ("i2v", I2V)):
        with VideoGenerator.from_pretrained(str(checkpoints[kind]), executor="inline") as gen:
            frames[kind] = gen.generate(PROMPT, save_video=False, **_kwargs(checkpoints, kind, request)).frames
    return frames


@pytest.mark.parametrize(("name", "kind", "sp", "cfg", "request_kwargs"), ENGINES, ids=[e[0] for e in ENGINES])
def test_torchrun_matches_inline(launch, inline, name, kind, sp, cfg, request_kwargs) -> None:
    frames = np.load(launch["dir"] / f"{name}-r.npy")
    assert inline[kind].std() > 1.0, "flat frames would prove nothing"
    assert int(np.abs(frames.astype(np.int16) - inline[kind].astype(np.int16)).max()) <= 2
    report = launch["report"][f"{name}-r"]
    assert report["has_frames"] == [True, False], "frames on rank 0 only"
    steps = request_kwargs["num_inference_steps"]
    forwards = steps if cfg else 2 * steps  # guidance on: both branches on every rank unless CFG-parallel
    for rank in report["ranks"]:
        assert rank["ulysses"].get("all_to_all", 0) == (2 * LAYERS * forwards if sp > 1 else 0)
        assert rank["ulysses"].get("text_head_gather", 0) == (LAYERS * forwards if sp > 1 else 0)
        assert rank["context"].get("cfg_all_gather", 0) == (steps if cfg else 0)
    if kind == "i2v":  # computed on rank 0, broadcast: the same bytes on both ranks
        records = [rank["conditioning"] for rank in report["ranks"]]
        assert records[0]["condition"] is not None and records[0]["condition"] == records[1]["condition"]
        contexts = [rank["context"] for rank in report["ranks"]]
        assert contexts[0]["conditioning_computed"] == 1 and contexts[1]["conditioning_received"] == 1


def test_torchrun_sp2_is_within_2_of_diffusers(launch, checkpoints) -> None:
    """The launched Ulysses sp=2 frames against diffusers' HunyuanVideo15Pipeline directly, not through the inline
    frames (two halves of 2 would allow 4): the same checkpoint, prompt, size, steps, guidance and seed."""
    from test_hunyuan import diffusers_hunyuan_frames

    request = {k: v for k, v in T2V.items() if k not in ("guidance_scale", "seed")}
    reference = diffusers_hunyuan_frames(
        checkpoints["t2v"], PROMPT, guidance_scale=T2V["guidance_scale"], seed=T2V["seed"], **request
    )
    frames = np.load(launch["dir"] / "t2v-sp2-r.npy")
    assert reference.std() > 1.0 and frames.shape == reference.shape
    assert int(np.abs(frames.astype(np.int16) - reference.astype(np.int16)).max()) <= 2


def test_banded_decode_of_the_hunyuan_vae_is_exact(launch) -> None:
    for i, shape in enumerate(DECODE_CHECKS):
        diffs = launch["report"][f"t2v-sp2-decode{i}"]
        assert diffs[1] is None, "the decoded video lands on rank 0 only"
        assert diffs[0] is not None and diffs[0] <= 1e-4, f"{shape}: banded vs single {diffs[0]}"
    counts = [rank["vae"] for rank in launch["report"]["t2v-sp2-r"]["ranks"]]  # the request's own decode: 2 bands
    assert all(c.get("halo_exchange", 0) > 0 and c.get("gather") == 1 for c in counts), counts


@pytest.fixture
def launched(launcher: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if launcher == "mpirun":
        folder, proc = MPIRUN.result()
        return _outcome(folder / "launch", proc)
    return _run(launcher, tmp_path, request.getfixturevalue("checkpoints"), OTHER_LAUNCHERS)


@pytest.mark.parametrize(
    "launcher", [pytest.param("srun", marks=pytest.mark.slurm), pytest.param("mpirun", marks=pytest.mark.mpi)]
)
def test_srun_and_mpirun_match_inline(launched, inline, launcher) -> None:
    """The same program under Slurm's srun and Open MPI's mpirun: Ulysses on text-to-video, CFG parallelism on
    image-to-video, one launch each."""
    run = launched
    for name, kind, *_ in OTHER_LAUNCHERS:
        frames = np.load(run["dir"] / f"{name}-r.npy")
        assert int(np.abs(frames.astype(np.int16) - inline[kind].astype(np.int16)).max()) <= 2, (launcher, name)
        assert run["report"][f"{name}-r"]["has_frames"] == [True, False]
