"""Frames recorded before the code was restructured (issue 13): the restructuring must not change a single value.

`tests/data/frames_before_restructure.npz` holds the frames of one guided request on the 4-layer test checkpoint,
inline and under the mp executor with sp=2, as returned by the API at commit 1d359f3 (x86-64, torch 2.13.0 CPU).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distvideo import VideoGenerator

RECORDED = Path(__file__).parent / "data" / "frames_before_restructure.npz"
PROMPT = "a lighthouse in a storm"
REQUEST = dict(num_frames=9, height=48, width=80, num_inference_steps=4, guidance_scale=5.0, seed=11, save_video=False)


@pytest.fixture(scope="module")
def recorded() -> dict[str, np.ndarray]:
    with np.load(RECORDED) as data:
        return {name: data[name] for name in data.files}


def test_inline_frames_are_the_recorded_ones(test_checkpoint, recorded):
    with VideoGenerator.from_pretrained(test_checkpoint, executor="inline") as gen:
        frames = gen.generate(PROMPT, **REQUEST).frames
    assert np.array_equal(frames, recorded["inline"])


@pytest.mark.slow
def test_sequence_parallel_frames_are_the_recorded_ones(test_checkpoint, recorded):
    with VideoGenerator.from_pretrained(
        test_checkpoint, executor="mp", num_gpus=2, cfg_parallel=False, sp_size=2
    ) as gen:
        frames = gen.generate(PROMPT, **REQUEST).frames
    assert np.array_equal(frames, recorded["mp_sp2"])
