"""The demo model's dataset (distvideo.testing.shapes) and the caption check (distvideo.testing.video_check)."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distvideo.testing import shapes
from distvideo.testing.video_check import check_video


def test_grammar_has_every_combination_but_invisible_ones():
    captions = shapes.all_captions()
    assert len(captions) == 5 * 3 * 4 * 3 - 3 * 4  # white on white is left out
    assert len({c.text for c in captions}) == len(captions)
    assert all(c.color != c.background for c in captions)
    assert shapes.parse_caption("a red ball moving left on a black background") == shapes.Caption(
        "red", "ball", "left", "black"
    )
    with pytest.raises(ValueError, match="color"):
        shapes.Caption("white", "ball", "left", "white")
    with pytest.raises(ValueError, match="shape"):
        shapes.parse_caption("a red cube moving left on a black background")
    with pytest.raises(ValueError, match="form"):
        shapes.parse_caption("a red fox running through snow")


def test_the_prompt_warning_knows_the_grammar_the_clips_are_drawn_from():
    """The warning about prompts the demo model cannot draw (models/embedded.py, which runs without the fixture
    builders) has the dataset's words, and warns about exactly the texts that are not a caption of its grammar."""
    from distvideo.models.embedded import DEMO_GRAMMAR, DEMO_MODEL_DIR, prompt_warning

    assert DEMO_GRAMMAR == {
        "color": tuple(shapes.COLORS),
        "shape": shapes.SHAPES,
        "direction": tuple(shapes.DIRECTIONS),
        "background": tuple(shapes.BACKGROUNDS),
    }
    assert all(prompt_warning(DEMO_MODEL_DIR, c.text) is None for c in shapes.all_captions())
    for text in ("a white ball moving left on a white background", "a red cube moving left on a black background"):
        assert prompt_warning(DEMO_MODEL_DIR, text) is not None
    assert prompt_warning(DEMO_MODEL_DIR.parent / "tiny-wan", "a red fox") is None  # other models: no grammar


def test_clips_are_deterministic_and_vary():
    a = shapes.sample_clip(7, 3)
    b = shapes.sample_clip(7, 3)
    assert a[0] == b[0] and np.array_equal(a[1], b[1])
    digests = {hashlib.sha256(shapes.sample_clip(7, i)[1].tobytes()).hexdigest() for i in range(20)}
    assert len(digests) == 20
    caption, frames = a
    assert frames.shape == (17, 64, 64, 3) and frames.dtype == np.uint8
    # two colours dominate: the background and the shape
    bg = np.asarray(shapes.BACKGROUNDS[caption.background])
    fg = np.asarray(shapes.COLORS[caption.color])
    near = (np.abs(frames.astype(int) - bg).max(-1) <= 2) | (np.abs(frames.astype(int) - fg).max(-1) <= 2)
    assert near.mean() > 0.95


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), index=st.integers(0, 10_000))
def test_every_clip_passes_the_check_of_its_own_caption(seed, index):
    caption, frames = shapes.sample_clip(seed, index)
    result = check_video(frames, caption)
    assert result.ok, result.reason


@pytest.mark.parametrize("caption", shapes.all_captions()[::7], ids=str)
def test_the_check_refuses_a_wrong_colour_or_direction(caption):
    _, frames = shapes.sample_clip(11, 0, caption=caption)
    assert check_video(frames, caption).ok
    other_color = next(c for c in shapes.COLORS if c not in (caption.color, caption.background))
    wrong = check_video(frames, dataclasses.replace(caption, color=other_color))
    assert not wrong.ok and "dominant colour" in wrong.reason
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}[caption.direction]
    assert not check_video(frames, dataclasses.replace(caption, direction=opposite)).ok
    # a still frame repeated does not move
    still = np.repeat(frames[:1], len(frames), axis=0)
    assert not check_video(still, caption).ok


def test_the_check_refuses_noise_and_empty_frames():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (17, 64, 64, 3), dtype=np.uint8)
    caption = shapes.all_captions()[0]
    assert not check_video(noise, caption).ok
    assert not check_video(np.zeros((17, 64, 64, 3), np.uint8), caption).ok
    with pytest.raises(ValueError, match="shape"):
        check_video(noise[..., 0], caption)
