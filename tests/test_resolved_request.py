"""A request is resolved once, at the edge (issue 50): `ModelInfo.resolve_request` makes a frozen ResolvedRequest
whose filled fields are set, a model that leaves one unfilled is refused naming it, and the generator takes a
ResolvedRequest as resolved (it never resolves it again) with the same frames as the request it came from."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from distvideo import GenerationRequest, ResolvedRequest, VideoGenerator
from distvideo.errors import ConfigError
from distvideo.models.registry import ModelInfo, probe_model
from distvideo.request import FILLED_BY_RESOLUTION

SMALL = dict(num_frames=5, height=32, width=32, num_inference_steps=2, seed=4, save_video=False)


def test_resolution_fills_and_freezes(tiny_model):
    info = probe_model(tiny_model)
    resolved = info.resolve_request(GenerationRequest(prompt="a boat"))
    assert isinstance(resolved, ResolvedRequest)
    for name in FILLED_BY_RESOLUTION:
        assert getattr(resolved, name) == info.defaults[name], name
    assert resolved.cache == "none"
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.height = 64  # type: ignore[misc]
    with pytest.raises(TypeError, match="one-expert"):
        resolved.second_expert  # noqa: B018


@pytest.mark.parametrize("missing", FILLED_BY_RESOLUTION)
def test_a_field_the_model_leaves_unset_is_refused_by_name(tiny_model, missing):
    info = probe_model(tiny_model)
    info = dataclasses.replace(info, defaults={k: v for k, v in info.defaults.items() if k != missing})
    with pytest.raises(ConfigError, match=f"^{missing}: the model sets no default") as exc:
        info.resolve_request(GenerationRequest(prompt="a boat"))
    assert exc.value.param == missing


def test_the_generator_takes_a_resolved_request_as_resolved(tiny_model, monkeypatch):
    with VideoGenerator.from_pretrained(tiny_model, executor="inline") as gen:
        given = gen.generate("a boat at dawn", **SMALL)
        assert isinstance(given.request, ResolvedRequest)

        def resolved_again(self, request, **kwargs):
            raise AssertionError("a ResolvedRequest was resolved again")

        monkeypatch.setattr(ModelInfo, "resolve_request", resolved_again)
        again = gen.generate_request(given.request)
    assert again.request == given.request
    assert np.array_equal(again.frames, given.frames)


def test_reading_the_image_makes_rgb_pixels_once(tiny_model):
    info = probe_model(tiny_model)
    resolved = info.resolve_request(GenerationRequest(prompt="a boat"), read_image=False)
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4)
    read = dataclasses.replace(resolved, image=grey).read_image()
    assert read.image.shape == (3, 4, 3) and np.array_equal(read.image[..., 1], grey)
    assert read.read_image() is read  # RGB pixels already: nothing read again
