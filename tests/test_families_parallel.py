"""Every model family on real torchrun launches (CPU, gloo): Ulysses SP, CFG parallelism and both together reproduce
the single-rank frames within 2; the banded decode is exact on the Wan2.2 VAE; the image conditioning is computed on
rank 0 and is bit-identical on every rank; the collectives are the expected ones for two experts and per-token
timesteps; an image missing on one node is refused on every rank before any denoising, and one at its own path on
each rank (the same bytes) gives the same frames.

Two launches serve every check: 2 ranks (sp=2 and cfg=2 engines of every family, all alive in one launch) and 4
ranks (sp=2 x cfg=2), in the background while the rest of the suite runs, each script in turn with other modules'
scripts of as many ranks in one torchrun launch (tests/launch_groups.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distvideo import VideoGenerator
from family_checkpoints import family_checkpoint, max_abs_diff, test_image
from launch_groups import LaunchCase, once, torchrun_case

from background import run_program
from conftest import REPO
from launchers import format_output

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

SCRIPT = REPO / "tests" / "parallel_scripts" / "family_cases.py"
LAYERS = 2  # every test checkpoint of tests/family_checkpoints.py

IMAGE = "<image>"  # replaced by the session's test image
# name -> (family, request). Tokens = latent frames x (rows / 2) x (columns / 2); decode bands split latent rows.
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    # 2 x 3 x 5 = 30 tokens; 6 latent rows
    "i2v": ("wan21_i2v", dict(image=IMAGE, num_frames=5, height=48, width=80, num_inference_steps=2, seed=1)),
    # UniPC with shift 12 at 4 steps: timesteps 1000, 973, 923 (high-noise expert), 800 (low-noise)
    "moe": ("wan22_t2v_a14b", dict(num_frames=5, height=32, width=48, num_inference_steps=4, guidance_scale=4.0,
                                   guidance_scale_2=2.5, seed=2)),
    "i2v14": ("wan22_i2v_a14b", dict(image=IMAGE, num_frames=5, height=48, width=32, num_inference_steps=3, seed=3)),
    # TI2V-5B: latents at 1/16, tokens at 1/32 of the pixels
    "ti2v_t2v": ("wan22_ti2v_5b", dict(num_frames=5, height=64, width=96, num_inference_steps=2, seed=4)),
    "ti2v_i2v": ("wan22_ti2v_5b", dict(image=IMAGE, num_frames=5, height=64, width=96, num_inference_steps=2,
                                       guidance_scale=4.0, seed=5)),
    # 3 x 3 x 1 = 9 tokens: sp=2 pads to 10; 6 latent rows: 3 bands on 4 ranks
    "ti2v_i2v_odd": ("wan22_ti2v_5b", dict(image=IMAGE, num_frames=9, height=96, width=32, num_inference_steps=2,
                                           seed=6)),
}  # fmt: skip
TWO_RANKS = [  # (engine, family, sp_size, cfg_parallel, requests)
    ("i2v-sp2", "wan21_i2v", 2, False, ["i2v"]),
    ("i2v-cfg2", "wan21_i2v", 1, True, ["i2v"]),
    ("t2v14-sp2", "wan22_t2v_a14b", 2, False, ["moe"]),
    ("t2v14-cfg2", "wan22_t2v_a14b", 1, True, ["moe"]),
    ("i2v14-sp2", "wan22_i2v_a14b", 2, False, ["i2v14"]),
    ("ti2v-sp2", "wan22_ti2v_5b", 2, False, ["ti2v_t2v", "ti2v_i2v_odd"]),
    ("ti2v-cfg2", "wan22_ti2v_5b", 1, True, ["ti2v_i2v"]),
]
FOUR_RANKS = [
    ("ti2v-sp2cfg2", "wan22_ti2v_5b", 2, True, ["ti2v_i2v_odd"]),
    ("i2v-sp2cfg2", "wan21_i2v", 2, True, ["i2v"]),
]
# engine -> requests whose image exists on rank 0 only (refused on every rank before any denoising)
REFUSALS = {"ti2v-sp2": {"missing_on_rank_1": "ti2v_i2v"}}
# engine -> requests whose image every rank reads from a copy at a path of its own (the same frames)
OWN_COPIES = {"i2v-sp2": {"own_copies": "i2v"}}
# the Wan2.2 VAE (z_dim 48, patchified, residual up blocks) decoded in bands: even rows, and 5 rows split 3 + 2
DECODE_CHECKS = {"ti2v-sp2": [[1, 48, 2, 6, 4], [1, 48, 2, 5, 3]]}


def _kwargs(request: str, image: Path) -> dict[str, Any]:
    return {k: (str(image) if v == IMAGE else v) for k, v in REQUESTS[request][1].items()}


def _argv(folder: Path, models: dict[str, Path], image: Path, engines: list[tuple]) -> list[str]:
    cases = [
        {
            "name": name,
            "model": str(models[family]),
            "sp_size": sp,
            "cfg_parallel": cfg,
            "requests": [{"name": r, "kwargs": _kwargs(r, image)} for r in requests],
            "decode_checks": DECODE_CHECKS.get(name, []),
            "refusals": [{"name": n, "kwargs": _kwargs(r, image)} for n, r in REFUSALS.get(name, {}).items()],
            "own_copies": [{"name": n, "kwargs": _kwargs(r, image)} for n, r in OWN_COPIES.get(name, {}).items()],
        }
        for name, family, sp, cfg, requests in engines
    ]
    (folder / "cases.json").write_text(json.dumps(cases))
    return [str(SCRIPT), str(folder / "cases.json"), str(folder)]


def _launched(case: LaunchCase) -> dict:
    folder, proc = case.result()
    assert proc.returncode == 0, format_output(proc)
    return {"dir": folder, "report": json.loads((folder / "report.json").read_text())}


# the session's checkpoints and test image (tests/family_checkpoints.py), built again in a process of their own: the
# same calls, so the same bytes as the ones the single-rank frames come from
BUILD = """
import sys
from pathlib import Path
from distvideo.testing.families import build_family_checkpoint, write_test_image
from family_checkpoints import SEEDS
out = Path(sys.argv[1])
write_test_image(out / "image.png", width=40, height=28, seed=0)
for family in sys.argv[2:]:
    build_family_checkpoint(family, out / family, scheduler="unipc", seed=SEEDS[family])
"""


@once
def _built(folder: Path, environ: dict[str, str]) -> tuple[dict[str, Path], Path]:
    """(family -> checkpoint, image), for both launches."""
    families = sorted({family for _, family, *_ in TWO_RANKS + FOUR_RANKS})
    path = os.pathsep.join(filter(None, [str(REPO / "tests"), environ.get("PYTHONPATH")]))
    build = run_program(
        [sys.executable, "-c", BUILD, str(folder), *families],
        threading.Event(),
        300,
        env={**environ, "PYTHONPATH": path},
    )
    assert build.returncode == 0, build.stderr
    return {family: folder / family for family in families}, folder / "image.png"


# two launches' scripts whose outcomes are all the tests check: in the background, each in turn with other modules'
# scripts of as many ranks (launch_groups.py)
TWO = torchrun_case("every family, 2 ranks", 2, lambda f, e: _argv(f, *_built(f, e), TWO_RANKS), timeout=600)
FOUR = torchrun_case("every family, 4 ranks", 4, lambda f, e: _argv(f, *_built(f, e), FOUR_RANKS), timeout=600)
BACKGROUND_JOBS = {"two_ranks": TWO.hooks, "four_ranks": FOUR.hooks}


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return _launched(TWO)


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return _launched(FOUR)


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory) -> dict[str, np.ndarray]:
    """Inline single-rank frames of every request the launches run."""
    wanted = sorted({r for *_, requests in TWO_RANKS + FOUR_RANKS for r in requests})
    image = test_image(tmp_path_factory)
    frames = {}
    for family in sorted({REQUESTS[r][0] for r in wanted}):
        with VideoGenerator.from_pretrained(family_checkpoint(tmp_path_factory, family), executor="inline") as gen:
            for r in (r for r in wanted if REQUESTS[r][0] == family):
                res = gen.generate("a red fox running through snow", save_video=False, **_kwargs(r, image))
                frames[r] = res.frames
    return frames


def _entries(engines: list[tuple]) -> list[tuple[str, str]]:
    return [(name, r) for name, _, _, _, requests in engines for r in requests]


def _check(run: dict, single_rank: dict, name: str, request: str) -> None:
    frames = np.load(run["dir"] / f"{name}-{request}.npy")
    reference = single_rank[request]
    assert reference.std() > 1.0, "flat frames would prove nothing"
    assert max_abs_diff(frames, reference) <= 2
    has_frames = run["report"][f"{name}-{request}"]["has_frames"]
    assert has_frames == [True] + [False] * (len(has_frames) - 1), "frames only on rank 0"


@pytest.mark.parametrize(("name", "request_name"), _entries(TWO_RANKS))
def test_two_ranks_match_single_rank(two_ranks, single_rank, name, request_name):
    _check(two_ranks, single_rank, name, request_name)


@pytest.mark.parametrize(("name", "request_name"), _entries(FOUR_RANKS))
def test_four_ranks_match_single_rank(four_ranks, single_rank, name, request_name):
    _check(four_ranks, single_rank, name, request_name)


@pytest.mark.parametrize("launch", ["two_ranks", "four_ranks"])
def test_image_conditioning_is_computed_once_and_identical_on_every_rank(launch, request):
    run = request.getfixturevalue(launch)
    for name, _, _, _, requests in TWO_RANKS if launch == "two_ranks" else FOUR_RANKS:
        for r in requests:
            records = [rank["conditioning"] for rank in run["report"][f"{name}-{r}"]["ranks"]]
            if "image" not in REQUESTS[r][1]:
                continue
            assert records[0]["condition"] is not None, f"{name}-{r}: no condition latents recorded"
            assert all(rec["condition"] == records[0]["condition"] for rec in records), (name, r)
            assert all(rec.get("image_embeds") == records[0].get("image_embeds") for rec in records), (name, r)
            if REQUESTS[r][0] == "wan21_i2v":
                assert records[0]["image_embeds"] is not None, "Wan2.1 I2V encodes the image with CLIP"
            # computed once, on rank 0 (CLIP tokens and condition latents for Wan2.1 I2V), and broadcast
            shared = 2 if REQUESTS[r][0] == "wan21_i2v" else 1
            contexts = [rank["context"] for rank in run["report"][f"{name}-{r}"]["ranks"]]
            assert contexts[0].get("conditioning_computed") == shared and "conditioning_received" not in contexts[0]
            assert all(c.get("conditioning_received") == shared and "conditioning_computed" not in c
                       for c in contexts[1:]), contexts  # fmt: skip


@pytest.mark.parametrize("launch", ["two_ranks", "four_ranks"])
def test_collective_counts(launch, request):
    """Two all-to-alls per self-attention layer per forward on either expert; one sequence gather per forward (before
    norm_out with per-token timesteps, after proj_out otherwise); one CFG all-gather per step."""
    run = request.getfixturevalue(launch)
    for name, _, sp, cfg, requests in TWO_RANKS if launch == "two_ranks" else FOUR_RANKS:
        for r in requests:
            kwargs = REQUESTS[r][1]
            steps = kwargs["num_inference_steps"]
            do_cfg = kwargs.get("guidance_scale", 5.0) > 1.0
            forwards = steps * (2 if do_cfg and not cfg else 1)
            for rank, counts in enumerate(run["report"][f"{name}-{r}"]["ranks"]):
                where = f"{name}-{r} rank {rank}"
                assert counts["ulysses"].get("all_to_all", 0) == (2 * LAYERS * forwards if sp > 1 else 0), where
                assert counts["ulysses"].get("all_gather", 0) == (forwards if sp > 1 else 0), where
                assert counts["context"].get("cfg_all_gather", 0) == (steps if cfg and do_cfg else 0), where
                assert counts["vae"].get("gather", 0) <= 1, where


def test_banded_decode_of_the_wan22_vae_is_exact(two_ranks):
    for i, shape in enumerate(DECODE_CHECKS["ti2v-sp2"]):
        diffs = two_ranks["report"][f"ti2v-sp2-decode{i}"]
        assert diffs[1] is None, "the decoded video lands on rank 0 only"
        assert diffs[0] is not None and diffs[0] <= 1e-4, f"{shape}: banded vs single {diffs[0]}"
    counts = [rank["vae"] for rank in two_ranks["report"]["ti2v-sp2-ti2v_t2v"]["ranks"]]
    assert all(c.get("halo_exchange", 0) > 0 and c.get("gather") == 1 for c in counts), counts


def test_image_missing_on_one_node_is_refused_on_every_rank(two_ranks):
    """Rank 1's image path does not exist: both ranks raise the same DivergentCallError naming rank 1's unreadable
    file, and no transformer forward ran (the Ulysses plan counted no all-to-all)."""
    report = two_ranks["report"]["ti2v-sp2-missing_on_rank_1"]
    errors = report["errors"]
    assert all(e is not None and e["type"] == "DivergentCallError" for e in errors), errors
    assert errors[0]["message"] == errors[1]["message"], "the same words on every rank"
    assert "rank 1: 'not readable on" in errors[0]["message"] and "FileNotFoundError" in errors[0]["message"]
    assert [rank["ulysses"].get("all_to_all", 0) for rank in report["ranks"]] == [0, 0]
    assert [rank["vae"].get("gather", 0) for rank in report["ranks"]] == [0, 0]


def test_an_image_at_its_own_path_on_each_rank_is_the_same_image(two_ranks):
    """Each rank reads the image from a copy at a path of its own (nodes holding their own copies): the ranks agree
    on it by its bytes, and the frames are those of the same request with one path on every rank, bit for bit."""
    outcomes = two_ranks["report"]["i2v-sp2-own_copies"]
    assert [o["error"] for o in outcomes] == [None, None], outcomes
    assert len({o["image"] for o in outcomes}) == 2, "every rank passed a path of its own"
    frames = np.load(two_ranks["dir"] / "i2v-sp2-own_copies.npy")
    reference = np.load(two_ranks["dir"] / "i2v-sp2-i2v.npy")
    assert np.array_equal(frames, reference), f"max abs difference {max_abs_diff(frames, reference)}"
