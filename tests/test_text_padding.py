"""The text-padding compaction of cross-attention (families/wan/text_padding.py): exact against diffusers' own forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from distvideo import VideoGenerator
from distvideo.families.wan.text_padding import TextPaddingPlan, trailing_run

from conftest import max_abs_diff


@pytest.mark.parametrize(
    "rows, expected",
    [
        ([1, 2, 3, 0, 0, 0], 3),  # a padding run of 3
        ([1, 2, 3, 4, 5, 6], 1),  # nothing repeats
        ([0, 0, 0, 0], 4),  # an empty text: all rows alike
        ([1, 0, 1, 1], 2),  # equal rows count only at the end
    ],
)
def test_trailing_run(rows, expected):
    embeds = torch.tensor(rows, dtype=torch.float32).view(1, -1, 1).expand(1, -1, 3)
    assert trailing_run(embeds) == expected


def test_trailing_run_is_the_minimum_over_the_batch():
    a = torch.tensor([1.0, 0, 0, 0, 0]).view(1, -1, 1)
    b = torch.tensor([1.0, 2, 3, 0, 0]).view(1, -1, 1)
    assert trailing_run(torch.cat([a, b])) == 2


def _transformer(test_checkpoint: Path):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(test_checkpoint / "transformer").eval()


@pytest.mark.parametrize("real_tokens", [0, 5, 40])
def test_compacted_forward_equals_diffusers_forward(test_checkpoint, real_tokens):
    model = _transformer(test_checkpoint)
    text_dim = model.config.text_dim
    gen = torch.Generator().manual_seed(real_tokens)
    x = torch.randn(1, model.config.in_channels, 3, 6, 10, generator=gen)
    embeds = torch.zeros(2, 64, text_dim)  # two texts of different lengths in one batch
    embeds[0, :real_tokens] = torch.randn(real_tokens, text_dim, generator=gen)
    embeds[1, : real_tokens // 2] = torch.randn(real_tokens // 2, text_dim, generator=gen)
    x, t = x.expand(2, -1, -1, -1, -1), torch.tensor([700.0, 700.0])
    with torch.no_grad():
        ref = model(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]
        plan = TextPaddingPlan()
        plan.apply(model)
        out = model(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]
    run = 64 - real_tokens  # the longer text decides (an empty text: all 64 rows alike)
    compacts = 64 - run + 1 <= 32  # pays only when at most half the rows remain
    assert plan.counts["compacted_forward"] == (1 if compacts else 0)
    assert plan.copies == (run if compacts else 1)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    plan.remove()
    assert all(type(b.attn2.processor).__name__ == "WanAttnProcessor" for b in model.blocks)


def test_same_embeddings_keep_one_identity_across_steps(test_checkpoint):
    plan = TextPaddingPlan()
    embeds = torch.zeros(1, 64, 8)
    embeds[:, :3] = 1.0
    first, copies = plan.compact(embeds)
    again, _ = plan.compact(embeds)
    assert copies == 61 and first.shape == (1, 4, 8) and again is first
    embeds.add_(1.0)  # changed in place: recomputed
    assert plan.compact(embeds)[0] is not first


def test_pipeline_frames_equal_with_and_without_compaction(tiny_model, monkeypatch):
    kwargs = dict(num_frames=5, height=32, width=48, num_inference_steps=3, guidance_scale=5.0, seed=2)
    frames = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("DISTVIDEO_COMPACT_TEXT_PADDING", flag)
        with VideoGenerator.from_pretrained(tiny_model, executor="inline") as gen:
            transformer = gen.executor.worker.pipeline.transformer
            names = {type(b.attn2.processor).__name__ for b in transformer.blocks}
            assert names == ({"CompactTextAttnProcessor"} if flag == "1" else {"WanAttnProcessor"})
            frames[flag] = gen.generate("a cat on a wall", negative_prompt="blur", save_video=False, **kwargs).frames
    assert frames["1"].std() > 1.0
    assert max_abs_diff(frames["0"], frames["1"]) <= 1
    assert not np.array_equal(frames["1"], np.zeros_like(frames["1"]))


def test_image_conditioned_models_are_left_alone():
    from diffusers import WanTransformer3DModel

    config = dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=8, freq_dim=16,
        ffn_dim=16, num_layers=1, image_dim=8, added_kv_proj_dim=16,
    )  # fmt: skip
    model = WanTransformer3DModel(**config)
    plan = TextPaddingPlan()
    plan.apply(model)
    assert not plan.applied and type(model.blocks[0].attn2.processor).__name__ == "WanAttnProcessor"
