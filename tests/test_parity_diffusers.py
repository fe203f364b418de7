"""Single-rank frames equal diffusers' WanPipeline frames for the same checkpoint, prompt and seed."""

from __future__ import annotations

import numpy as np
import pytest

from distvideo import VideoGenerator

from conftest import diffusers_frames, max_abs_diff


@pytest.fixture(scope="module")
def embedded_generator(tiny_model):
    with VideoGenerator.from_pretrained(tiny_model, executor="inline") as gen:
        yield gen


def test_embedded_model_matches_diffusers(embedded_generator, tiny_model):
    res = embedded_generator.generate("a red fox running through snow", seed=7, save_video=False)
    defaults = embedded_generator.model_info.defaults
    ref = diffusers_frames(
        tiny_model,
        "a red fox running through snow",
        seed=7,
        num_frames=defaults["num_frames"],
        height=defaults["height"],
        width=defaults["width"],
        num_inference_steps=defaults["num_inference_steps"],
        guidance_scale=defaults["guidance_scale"],
    )
    assert res.frames.shape == (defaults["num_frames"], defaults["height"], defaults["width"], 3)
    assert res.frames.std() > 1.0, "frames are flat: the comparison would prove nothing"
    assert max_abs_diff(res.frames, ref) <= 2


def test_unipc_nonsquare_cfg_checkpoint_matches_diffusers(test_checkpoint):
    kwargs = dict(num_frames=9, height=48, width=80, num_inference_steps=5, guidance_scale=4.5)
    with VideoGenerator.from_pretrained(test_checkpoint, executor="inline") as gen:
        assert gen.model_info.index["scheduler"][1] == "UniPCMultistepScheduler"
        res = gen.generate("a lighthouse at dusk", negative_prompt="blurry", seed=11, save_video=False, **kwargs)
    ref = diffusers_frames(test_checkpoint, "a lighthouse at dusk", negative_prompt="blurry", seed=11, **kwargs)
    assert res.frames.shape == (9, 48, 80, 3)
    assert max_abs_diff(res.frames, ref) <= 2


def test_without_guidance_matches_diffusers(embedded_generator, tiny_model):
    kwargs = dict(num_frames=5, height=32, width=48, num_inference_steps=3, guidance_scale=1.0)
    res = embedded_generator.generate("waves", seed=1, save_video=False, **kwargs)
    ref = diffusers_frames(tiny_model, "waves", seed=1, **kwargs)
    assert max_abs_diff(res.frames, ref) <= 2


def test_seed_determines_frames(embedded_generator):
    kwargs = dict(num_frames=5, height=32, width=32, num_inference_steps=2, save_video=False)
    a = embedded_generator.generate("a cat", seed=3, **kwargs).frames
    b = embedded_generator.generate("a cat", seed=3, **kwargs).frames
    c = embedded_generator.generate("a cat", seed=4, **kwargs).frames
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
