"""Image conditioning stays inside its replica (issue 26, defect 1): a batch of image-to-video items with different
images over two replicas gives each item the video of its own single run, for every image family, on mp and under
torchrun, and with replicas of two ranks (the replica's first rank encodes and broadcasts to its replica only).

Before the fix the conditioning was broadcast from world rank 0 on the default group, so the item on replica 1 was
conditioned on replica 0's image.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from pathlib import Path

import pytest

from distvideo.cli.main import main
from family_checkpoints import SEEDS, family_checkpoint, test_image
from launch_groups import torchrun_case

from background import run_program
from launchers import format_output

pytestmark = pytest.mark.slow

#: family -> a small request its checkpoint takes (sizes as in tests/test_families_parallel.py)
FAMILIES = {
    "wan21_i2v": ["--num-frames", "5", "--height", "48", "--width", "80", "--steps", "2"],
    "wan22_i2v_a14b": ["--num-frames", "5", "--height", "48", "--width", "32", "--steps", "3"],
    "wan22_ti2v_5b": ["--num-frames", "5", "--height", "64", "--width", "96", "--steps", "2"],
}


IMAGE_SEEDS = (21, 22)


def _items(folder: Path, images: list[Path]) -> Path:
    """The prompt file: two items with different images and seeds."""
    prompts = folder / "items.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": "a red fox running through snow", "image": str(image), "seed": 7 + i}) + "\n"
            for i, image in enumerate(images)
        )
    )
    return prompts


def _batch(factory: pytest.TempPathFactory, family: str) -> tuple[Path, Path, list[str]]:
    """(model, prompt file, the CLI's request flags)."""
    folder = factory.mktemp(f"replica-images-{family}")
    prompts = _items(folder, [test_image(factory, seed=seed) for seed in IMAGE_SEEDS])
    return family_checkpoint(factory, family), prompts, [*FAMILIES[family], "--no-progress"]


def _videos(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.mp4"))}


def _replicas(folder: Path) -> set[int]:
    return {json.loads(line)["replica"] for line in (folder / "manifest.jsonl").read_text().splitlines()}


#: the API's name of each request flag in FAMILIES
API_NAMES = {"num_frames": "num-frames", "height": "height", "width": "width", "num_inference_steps": "steps"}


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory) -> dict[str, tuple[Path, Path, list[str], dict[str, str], list]]:
    """Per family: the batch, each item's video from one inline rank (every item run alone, in order), and its
    frames (the batch API on the inline executor, which writes the files the CLI writes)."""
    from distvideo import VideoGenerator

    out = {}
    for family in FAMILIES:
        model, prompts, flags = _batch(tmp_path_factory, family)
        folder = prompts.parent / "inline"
        items = [json.loads(line) for line in prompts.read_text().splitlines()]
        flag = dict(zip(flags[:-1:2], flags[1:-1:2], strict=True))
        request = {name: int(flag[f"--{key}"]) for name, key in API_NAMES.items()}
        with VideoGenerator.from_pretrained(model, executor="inline") as gen:
            results = gen.generate_batch(items, output_dir=folder, return_frames=True, progress=False, **request)
        videos = _videos(folder)
        assert len(videos) == 2 and len(set(videos.values())) == 2, "two images must give two different videos"
        out[family] = (model, prompts, flags, videos, [r.frames for r in results])
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mp_replicas_condition_each_item_on_its_own_image(family, single_runs, tmp_path):
    model, prompts, flags, expected, _ = single_runs[family]
    argv = ["generate", "--model", str(model), "--prompts", str(prompts), "--output", str(tmp_path), *flags]
    assert main([*argv, "--executor", "mp", "--num-gpus", "2", "--replicas", "2"]) == 0
    assert _replicas(tmp_path) == {0, 1}, "each replica ran one item"
    assert _videos(tmp_path) == expected


BUILD = (
    "import sys; from distvideo.testing.families import build_family_checkpoint, write_test_image; "
    "build_family_checkpoint('wan21_i2v', sys.argv[1] + '/model', scheduler='unipc', seed=int(sys.argv[2])); "
    "[write_test_image(f'{sys.argv[1]}/image-{s}.png', width=40, height=28, seed=s) for s in map(int, sys.argv[3:])]"
)


def _argv(folder: Path, environ: dict[str, str]) -> list[str]:
    """The torchrun launch's command, on a checkpoint and images of its own (built in a process of its own: the same bytes as
    the session's, family_checkpoints.py, which the single runs come from)."""
    seeds = [str(seed) for seed in IMAGE_SEEDS]
    build = run_program(
        [sys.executable, "-c", BUILD, str(folder), str(SEEDS["wan21_i2v"]), *seeds], threading.Event(), 300, env=environ
    )
    assert build.returncode == 0, build.stderr
    prompts = _items(folder, [folder / f"image-{seed}.png" for seed in IMAGE_SEEDS])
    argv = ["-m", "distvideo", "generate", "--model", str(folder / "model"), "--prompts", str(prompts)]
    flags = [*FAMILIES["wan21_i2v"], "--no-progress", "--replicas", "2"]
    return [*argv, "--output", str(folder / "out"), *flags]


# a launch whose outcome is all the test checks: in the background, in turn with other modules' scripts of 2 ranks
# (launch_groups.py)
LAUNCH = torchrun_case("replicas' image conditioning under torchrun", 2, _argv, timeout=300)
BACKGROUND_JOBS = {"launched": LAUNCH.hooks}


launched = LAUNCH.fixture("launched")


@pytest.mark.launcher
def test_launched_replicas_condition_each_item_on_its_own_image(single_runs, launched):
    """Under torchrun (the issue's reproduction), on the family with two conditioning broadcasts (CLIP tokens and the
    first-frame latents); the other families take the same code path, shown on mp above."""
    *_, expected, _ = single_runs["wan21_i2v"]
    folder, proc = launched
    assert proc.returncode == 0, format_output(proc)
    assert _replicas(folder / "out") == {0, 1}, "each replica ran one item"
    assert _videos(folder / "out") == expected


def test_replicas_of_two_ranks_broadcast_inside_their_replica(single_runs, tmp_path):
    """4 ranks = 2 replicas x sp 2: the conditioning is encoded on each replica's first rank (0 and 2) and broadcast
    to its replica. sp=2 is another layout than one rank, so frames may differ from the single run by rounding;
    compared as frames within 2 through the returned arrays of generate_batch."""
    import numpy as np

    from distvideo import VideoGenerator

    model, prompts, flags, _, single = single_runs["wan21_i2v"]
    items = [json.loads(line) for line in prompts.read_text().splitlines()]
    flag = dict(zip(flags[:-1:2], flags[1:-1:2], strict=True))
    request = {name: int(flag[f"--{key}"]) for name, key in API_NAMES.items()}
    assert int(np.abs(single[0].astype(int) - single[1].astype(int)).max()) > 10, "the two images must matter"
    with VideoGenerator.from_pretrained(model, executor="mp", num_gpus=4, replicas=2, sp_size=2) as gen:
        results = gen.generate_batch(items, output_dir=tmp_path, return_frames=True, progress=False, **request)
    assert _replicas(tmp_path) == {0, 1}, "each replica ran one item"
    for result, frames in zip(results, single, strict=True):
        assert int(np.abs(result.frames.astype(int) - frames.astype(int)).max()) <= 2
