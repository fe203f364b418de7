"""Ring attention and USP (sp = ulysses x ring): the log-sum-exp merge against full attention (one process), and
frames within 2 of one rank for ring 2 (mp), ring 4, ulysses 2 x ring 2, cfg 2 x ring 2, a 6-head checkpoint at sp 4
(Ulysses 2 takes what divides the heads, ring 2 the rest), every family at ring 4 (Wan2.1 I2V, Wan2.2 TI2V-5B with
per-token timesteps, HunyuanVideo 1.5 T2V and I2V, whose joint attention merges the valid text keys with the ring's
video blocks) and Wan2.2 A14B (two experts) at cfg 2 x ring 2 (4 ranks in one srun launch over two emulated nodes, so
a ring spans the nodes while Ulysses stays in one) and cfg 2 x ulysses 2 x ring 2 (8 ranks under torchrun). Sizes are
tiny and steps 2: 8 gloo ranks share 2 cores here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distvideo import VideoGenerator
from distvideo.models import compat
from distvideo.models.embedded import tiny_model_path
from distvideo.parallel.ring import merge_partials, real_keys
from distvideo.testing.checkpoints import build_tiny_wan
from family_checkpoints import family_checkpoint, test_image
from launch_groups import torchrun_case
from test_hunyuan import NEGATIVE as HUNYUAN_NEGATIVE
from test_hunyuan import PROMPT as HUNYUAN_PROMPT
from test_hunyuan import REQUEST as HUNYUAN_REQUEST
from test_hunyuan import hunyuan_checkpoint
from test_hunyuan_i2v import REQUEST as HUNYUAN_I2V_REQUEST
from test_hunyuan_i2v import hunyuan_i2v_checkpoint

from conftest import REPO, max_abs_diff
from launchers import format_output, run_launcher

SCRIPT = REPO / "tests" / "parallel_scripts" / "run_cases.py"
PROMPT = "a red fox running through snow"
# latent 3 x 6 x 6 -> 27 tokens: padded to 28 on 2 and 4 ranks and to 32 on 8, so the last chunks hold padding
ODD = dict(num_frames=9, height=48, width=48, num_inference_steps=2, seed=2)
IMAGE = "<image>"  # replaced by the session's test image
REQUESTS = {
    "odd": ODD,
    # Wan2.1 I2V (CLIP image tokens, the image latent on 36 channels): 2 x 3 x 3 = 18 tokens, padded to 20 on 4 ranks
    "i2v": dict(image=IMAGE, num_frames=5, height=48, width=48, num_inference_steps=2, guidance_scale=5.0, seed=4),
    # TI2V-5B: 3 x 3 x 1 = 9 tokens, padded to 12 on 4 ranks: the last ring chunk is padding only
    "ti2v": dict(image=IMAGE, num_frames=9, height=96, width=32, num_inference_steps=2, seed=6),
    # A14B: UniPC with shift 12 at 4 steps, both experts; 2 x 2 x 3 = 12 tokens
    "moe": dict(num_frames=5, height=32, width=48, num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.5),
    # HunyuanVideo 1.5, tests/test_hunyuan.py's request (a glyph prompt and a negative one): 3 x 3 x 5 = 45 video
    # tokens, padded to 48 on 4 ranks; I2V at the image's bucket, 48 x 64: 3 x 3 x 4 = 36
    "hv15": dict(prompt=HUNYUAN_PROMPT, negative_prompt=HUNYUAN_NEGATIVE, **HUNYUAN_REQUEST),
    "hv15-i2v": dict(prompt=HUNYUAN_PROMPT, negative_prompt=HUNYUAN_NEGATIVE, image=IMAGE, **HUNYUAN_I2V_REQUEST),
}
# (name, model, request, sp_size, cfg_parallel, ulysses_size, ring_size, want (ulysses, ring))
FOUR_RANKS = [
    ("ring4", "embedded", "odd", 4, False, None, 4, [1, 4]),
    ("u2r2", "embedded", "odd", 4, False, 2, 2, [2, 2]),
    ("cfg2r2", "embedded", "odd", 2, True, 1, 2, [1, 2]),
    ("heads6-sp4", "heads6", "odd", 4, False, None, None, [2, 2]),  # 4 does not divide 6 heads: no longer refused
    ("i2v-ring4", "wan21_i2v", "i2v", 4, False, None, 4, [1, 4]),
    ("ti2v-ring4", "wan22_ti2v_5b", "ti2v", 4, False, None, 4, [1, 4]),
    ("moe-cfg2r2", "wan22_t2v_a14b", "moe", 2, True, None, 2, [1, 2]),
    ("hv15-ring4", "hunyuan15", "hv15", 4, False, None, 4, [1, 4]),
    ("hv15-i2v-ring4", "hunyuan15_i2v", "hv15-i2v", 4, False, None, 4, [1, 4]),
]
EIGHT_RANKS = [("cfg2u2r2", "embedded", "odd", 4, True, 2, 2, [2, 2])]


# --- the merge, in one process ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lse_merge_of_key_blocks_equals_full_attention(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 3, 16, generator=g).to(dtype) for n in (11, 23, 23))
    full = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2).float()
    out = lse = None
    for start, stop in [(0, 7), (7, 8), (8, 23)]:  # uneven blocks, one of a single key
        block_out, block_lse = compat.attention_with_lse(q, k[:, start:stop], v[:, start:stop])
        out, lse = merge_partials(out, lse, block_out, block_lse)
    scores = (q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2)) / 4.0
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1).transpose(1, 2), atol=1e-4)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 inputs: the kernel's own output rounding
    assert (out - full).abs().max() <= tolerance


def test_real_keys_leave_the_padding_out():
    # 27 tokens padded to 32, in 4 chunks of 8: the last chunk holds 3 real keys; 2 chunks of 14 (28): 14 and 13
    assert [real_keys(27, 8, r) for r in range(4)] == [8, 8, 8, 3]
    assert [real_keys(27, 14, r) for r in range(2)] == [14, 13]
    assert real_keys(5, 4, 3) == 0  # a chunk of padding only


# --- frames against one rank -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory) -> dict[str, Path]:
    heads6 = build_tiny_wan(tmp_path_factory.mktemp("heads6") / "ckpt", num_attention_heads=6, num_layers=2, seed=5)
    families = {
        name: family_checkpoint(tmp_path_factory, name) for name in ("wan21_i2v", "wan22_ti2v_5b", "wan22_t2v_a14b")
    }
    hunyuan = {
        "hunyuan15": hunyuan_checkpoint(tmp_path_factory),
        "hunyuan15_i2v": hunyuan_i2v_checkpoint(tmp_path_factory),
    }
    return {"embedded": tiny_model, "heads6": heads6, **families, **hunyuan}


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    return str(test_image(tmp_path_factory))


def _kwargs(request: str, image: str) -> dict:
    """The request's keywords for generate(), its prompt among them (PROMPT unless the request names one)."""
    return {"prompt": PROMPT} | {k: (image if v == IMAGE else v) for k, v in REQUESTS[request].items()}


@pytest.fixture(scope="module")
def single_rank(models, image) -> dict[tuple[str, str], np.ndarray]:
    frames = {}
    for _, model, request, *_ in FOUR_RANKS + EIGHT_RANKS:
        if (model, request) in frames:
            continue
        with VideoGenerator.from_pretrained(models[model], executor="inline") as gen:
            frames[(model, request)] = gen.generate(save_video=False, **_kwargs(request, image)).frames
            assert frames[(model, request)].std() > 1.0, "flat frames would prove nothing"
    return frames


def _argv(tmp: Path, engines: list[tuple], models: dict[str, Path], image: str) -> list[str]:
    cases = [
        {
            "name": name,
            "model": str(models[model]),
            "sp_size": sp,
            "cfg_parallel": cfg,
            "ulysses_size": ulysses,
            "ring_size": ring,
            "requests": [{"name": request, "kwargs": _kwargs(request, image)}],
        }
        for name, model, request, sp, cfg, ulysses, ring, _ in engines
    ]
    (tmp / "cases.json").write_text(json.dumps(cases))
    return [str(SCRIPT), str(tmp / "cases.json"), str(tmp)]


def _report(tmp: Path, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, format_output(proc)
    return json.loads((tmp / "report.json").read_text())


def _launch(
    tmp: Path, engines: list[tuple], nproc: int, models: dict[str, Path], image: str, launcher: str, nodes: int = 1
) -> dict:
    argv = _argv(tmp, engines, models, image)
    return _report(tmp, run_launcher(launcher, argv, nproc=nproc, nodes=nodes, timeout=400))


def _check(tmp: Path, report: dict, engines: list[tuple], single_rank: dict) -> None:
    for name, model, request, *_, want in engines:
        entry = report[f"{name}-{request}"]
        assert all(c["usp"] == want for c in entry["plan_counts"]), (name, entry["plan_counts"])
        # ring - 1 passes per self-attention (2 layers: Wan's blocks' attn1, HunyuanVideo's transformer_blocks' joint
        # attn; the refiner's stays local), per step, one branch per rank or two without cfg (every request guides)
        steps = REQUESTS[request]["num_inference_steps"]
        forwards = steps * (1 if any(c["layout"][1] == 2 for c in entry["plan_counts"]) else 2)
        passes = (want[1] - 1) * 2 * forwards
        assert [c["ring"].get("ring_pass", 0) for c in entry["plan_counts"]] == [passes] * len(entry["plan_counts"])
        frames = np.load(tmp / f"{name}-{request}.npy")
        reference = single_rank[(model, request)]
        assert frames.shape == reference.shape
        assert max_abs_diff(frames, reference) <= 2, name
        assert entry["has_frames"] == [True] + [False] * (len(entry["has_frames"]) - 1)


@pytest.mark.launcher
@pytest.mark.slurm
@pytest.mark.slow
def test_usp_layouts_on_four_srun_ranks_over_two_nodes_match_single_rank(tmp_path, models, image, single_rank):
    report = _launch(tmp_path, FOUR_RANKS, 4, models, image, "srun", nodes=2)
    _check(tmp_path, report, FOUR_RANKS, single_rank)


# 8 ranks on 2 cores (25 s) whose outcome is all the test checks (the embedded model only, no image): in the
# background, in turn with other modules' scripts of 8 ranks (launch_groups.py)
EIGHT = torchrun_case(
    "ring: 8 ranks", 8, lambda folder, environ: _argv(folder, EIGHT_RANKS, {"embedded": tiny_model_path()}, ""), 400
)
BACKGROUND_JOBS = {"eight_ranks": EIGHT.hooks}


@pytest.fixture
def eight_ranks() -> tuple[Path, dict]:
    folder, proc = EIGHT.result()
    return folder, _report(folder, proc)


@pytest.mark.launcher
@pytest.mark.slow
def test_cfg2_ulysses2_ring2_on_eight_ranks_matches_single_rank(eight_ranks, single_rank):
    tmp, report = eight_ranks
    _check(tmp, report, EIGHT_RANKS, single_rank)


@pytest.mark.slow
def test_ring2_on_mp_matches_single_rank(models, single_rank):
    with VideoGenerator.from_pretrained(
        models["embedded"], executor="mp", num_gpus=2, cfg_parallel=False, ring_size=2
    ) as gen:
        assert gen.engine.layout.describe() == "world 2 = cfg 1 x sp 2 (ulysses 1 x ring 2)"
        assert gen.collective_rpc("applied_plans")[0]["transformer"][0] == "usp"
        res = gen.generate(PROMPT, save_video=False, **ODD)
    assert max_abs_diff(res.frames, single_rank[("embedded", "odd")]) <= 2
