"""HunyuanVideo 1.5 on the parallel layouts, mp executor, two CPU ranks (gloo): CFG parallelism (cfg=2), Ulysses
(sp=2: the joint-attention processor of families/hunyuan15/attention.py, 45 video tokens, so one padded token) and ring
attention (ring=2: the valid text keys merged with the ring's video blocks) give frames within 2 (uint8) of inline,
and the plans and collectives that ran are the declared ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distvideo import VideoGenerator
from test_hunyuan import NEGATIVE, PROMPT, REQUEST, hunyuan_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hunyuan_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def inline_frames(checkpoint: Path) -> np.ndarray:
    with VideoGenerator.from_pretrained(str(checkpoint)) as gen:
        frames = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **REQUEST).frames
    assert frames is not None
    return frames


def _collectives(worker) -> dict[str, int]:
    counts = dict(worker.parallel.counts)
    ulysses = worker.parallel.ulysses
    if ulysses is not None:
        counts.update(ulysses.counts)
        if ulysses.ring is not None:
            counts.update(ulysses.ring.counts)
    return counts


@pytest.mark.parametrize(
    ("layout", "expected_plans"),
    [
        (dict(cfg_parallel=True), ["cpu-kernels", "step-cache"]),
        # no text-projection memo: the family declares none (its text stream changes in every block)
        (dict(cfg_parallel=False, sp_size=2), ["ulysses", "cpu-kernels", "step-cache"]),
        (dict(cfg_parallel=False, sp_size=2, ring_size=2), ["usp", "cpu-kernels", "step-cache"]),
    ],
    ids=["cfg2", "sp2", "ring2"],
)
def test_mp_layout_matches_inline(checkpoint: Path, inline_frames: np.ndarray, layout, expected_plans) -> None:
    with VideoGenerator.from_pretrained(str(checkpoint), num_gpus=2, executor="mp", **layout) as gen:
        result = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **REQUEST)
        plans = gen.collective_rpc("applied_plans")
        counts = gen.collective_rpc(_collectives)
    assert result.frames is not None
    assert int(np.abs(result.frames.astype(np.int16) - inline_frames.astype(np.int16)).max()) <= 2
    assert all(p["transformer"] == expected_plans for p in plans), plans
    steps, layers = REQUEST["num_inference_steps"], 2
    if layout.get("ring_size") == 2:  # no Ulysses: one key/value pass per layer and forward, no head gather
        assert counts[0]["ring_pass"] == 2 * steps * layers and "all_to_all" not in counts[0]
        assert "text_head_gather" not in counts[0]
    elif layout.get("sp_size") == 2:  # both branches on every rank: 2 forwards per step, 2 all-to-alls per layer
        assert counts[0]["all_to_all"] == 2 * 2 * steps * layers
        assert counts[0]["text_head_gather"] == 2 * steps * layers
        assert counts[0]["all_gather"] == 2 * steps  # the output gather after proj_out
    else:  # one branch per rank, one all-gather per step brings the other
        assert counts[0]["cfg_all_gather"] == steps
