"""HunyuanVideo 1.5 with the speed and memory options: `--offload text` and `--offload model` give the bytes of
`--offload none` with both text encoders (Qwen2.5-VL and ByT5) and the VAE in host memory outside their stages, and
`--compile` (regional, its dual-stream blocks) gives frames within 2 of eager. The device is ``cpu:0``, host memory
that a move can still be told apart by (tests/test_offload.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distvideo import VideoGenerator
from distvideo.config import EngineConfig
from test_hunyuan import NEGATIVE, PROMPT, REQUEST, hunyuan_checkpoint

from conftest import max_abs_diff

pytestmark = pytest.mark.slow


def _generator(model: Path, **options) -> VideoGenerator:
    config = EngineConfig(model=str(model), executor="inline", device="cpu:0", progress=False, **options)
    return VideoGenerator.from_config(config)


def _run(gen: VideoGenerator) -> np.ndarray:
    frames = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **REQUEST).frames
    assert frames is not None
    return frames


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hunyuan_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def plain(model: Path) -> np.ndarray:
    with _generator(model) as gen:
        return _run(gen)


@pytest.mark.parametrize(
    ("mode", "offloaded"),
    [("text", ("text_encoder", "text_encoder_2")), ("model", ("text_encoder", "text_encoder_2", "vae"))],
)
def test_offload_gives_the_same_bytes_with_both_text_encoders_away(
    model: Path, plain: np.ndarray, mode: str, offloaded: tuple[str, ...]
) -> None:
    with _generator(model, offload=mode) as gen:
        frames = _run(gen)
        offload = gen.collective_rpc(lambda worker: worker.pipeline.offload)[0]  # inline: the rank is here
    assert frames.tobytes() == plain.tobytes(), f"offload={mode} changed the frames"
    assert offload.offloaded == offloaded
    assert offload.placement == {name: "host" if name in offloaded else "device" for name in offload.placement}
    # after the placement at load, each offloaded component visits the device once, for its stage
    visits = offload.moves[len(offload.placement) :]
    one_visit = {name: ["device", "host"] for name in offloaded}
    assert {name: [where for n, where in visits if n == name] for name in offloaded} == one_visit
    assert {name for name, _ in visits} == set(offloaded)


def test_compiled_frames_are_within_2_of_eager(model: Path, plain: np.ndarray) -> None:
    with _generator(model, compile=True) as gen:
        result = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **REQUEST)
        plans = gen.collective_rpc("applied_plans")[0]
    assert plans["transformer"][-1] == "compile"
    assert result.timings["compile"] > 0
    assert max_abs_diff(result.frames, plain) <= 2
