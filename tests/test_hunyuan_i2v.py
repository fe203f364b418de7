"""HunyuanVideo 1.5 image-to-video: the size follows the image's aspect-ratio bucket as in diffusers (unless the request
sets one), an image is required, and inline frames are within 2 (uint8) of HunyuanVideo15ImageToVideoPipeline's on
the same random-weight checkpoint, image, prompt and seed (the parallel layouts: tests/test_hunyuan_launch.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distvideo import ConfigError, VideoGenerator
from distvideo.models.registry import probe_model
from distvideo.request import GenerationRequest
from distvideo.worker import pipeline_class
from test_hunyuan import NEGATIVE, PROMPT

REQUEST = dict(num_frames=9, num_inference_steps=2, guidance_scale=4.5, seed=5)


def hunyuan_i2v_checkpoint(factory: pytest.TempPathFactory) -> Path:
    """The session's image-to-video checkpoint (built once; batch and serve share it), whose target size is 64: a
    40 x 28 image gives a 64 x 48 video."""
    from distvideo.testing.hunyuan import build_hunyuan_checkpoint

    path = factory.getbasetemp() / "hunyuan15-i2v"
    if not (path / "model_index.json").is_file():
        build_hunyuan_checkpoint(path, seed=22, image_to_video=True, target_size=64)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hunyuan_i2v_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from distvideo.testing.families import write_test_image

    return write_test_image(tmp_path_factory.mktemp("images") / "first.png", width=40, height=28, seed=1)


def test_size_follows_the_image(checkpoint: Path, image: Path) -> None:
    info = probe_model(checkpoint)
    assert info.family.name == "HunyuanVideo 1.5 I2V"
    assert pipeline_class(info.family).__name__ == "HunyuanVideo15I2VPipeline"
    resolved = info.resolve_request(GenerationRequest(prompt="x", image=str(image)))
    assert (resolved.height, resolved.width) == (48, 64)  # the bucket at target size 64 closest to 28 / 40
    tall = info.resolve_request(GenerationRequest(prompt="x", image=np.zeros((40, 28, 3), np.uint8)))
    assert (tall.height, tall.width) == (64, 48)
    chosen = info.resolve_request(GenerationRequest(prompt="x", image=str(image), height=32, width=32))
    assert (chosen.height, chosen.width) == (32, 32)  # a size the request sets is kept
    with pytest.raises(ConfigError, match=r"pass the first frame as image= \(a path"):  # the API's keyword
        info.resolve_request(GenerationRequest(prompt="x"))


@pytest.mark.slow
def test_inline_frames_match_diffusers(checkpoint: Path, image: Path) -> None:
    import torch
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15ImageToVideoPipeline
    from PIL import Image

    with VideoGenerator.from_pretrained(str(checkpoint)) as gen:
        result = gen.generate(PROMPT, negative_prompt=NEGATIVE, image=str(image), save_video=False, **REQUEST)
    assert result.frames is not None and result.frames.shape == (9, 48, 64, 3)
    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(str(checkpoint))
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=REQUEST["guidance_scale"])
    out = pipe(
        image=Image.open(image).convert("RGB"),
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        num_frames=REQUEST["num_frames"],
        num_inference_steps=REQUEST["num_inference_steps"],
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        output_type="np",
    ).frames[0]
    reference = np.round(out * 255).astype(np.uint8)
    assert int(np.abs(reference.astype(np.int16) - result.frames.astype(np.int16)).max()) <= 2
    assert result.frames.std() > 10  # not a flat video


@pytest.mark.slow
def test_thread_counts_stay_within_the_tolerance(
    checkpoint: Path, image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One and two intra-op threads: within the parity tolerance (2), not byte for byte on every CPU (ATen splits
    SigLIP's GELU of 729 x 32 values by thread count; on AVX-512 a piece's scalar tail rounds unlike the vector path:
    docs/determinism.md). Byte identity across executors is promised at the same thread count per rank."""
    import torch

    frames = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            monkeypatch.setenv("DISTVIDEO_NUM_THREADS", str(threads))
            with VideoGenerator.from_pretrained(str(checkpoint)) as gen:
                assert torch.get_num_threads() == threads
                frames[threads] = gen.generate(PROMPT, image=str(image), save_video=False, **REQUEST).frames
    finally:
        torch.set_num_threads(before)
    assert frames[1] is not None and frames[2] is not None and frames[1].std() > 10
    assert int(np.abs(frames[1].astype(np.int16) - frames[2].astype(np.int16)).max()) <= 2
