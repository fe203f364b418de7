"""The families in the registry and their requests: which checkpoint is which family, what each family refuses (a
ConfigError naming the family and the parameter, before any weight loads), the image forms, and the per-family
defaults (including the CLI's fps)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from distvideo import ConfigError
from distvideo.cli.main import main
from distvideo.config import Naming
from distvideo.models.registry import probe_model
from distvideo.request import GenerationRequest
from distvideo.worker import pipeline_class
from family_checkpoints import family_checkpoint, test_image

FAMILY_NAMES = {
    "wan21_i2v": "Wan2.1 I2V",
    "wan22_t2v_a14b": "Wan2.2 T2V-A14B",
    "wan22_i2v_a14b": "Wan2.2 I2V-A14B",
    "wan22_ti2v_5b": "Wan2.2 TI2V-5B",
}


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is loaded (bad input must be refused before)."""
    import distvideo.worker

    def no_loading(*a, **k):
        raise AssertionError("model weights were loaded for a bad request")

    monkeypatch.setattr(distvideo.worker, "load_components", no_loading)


@pytest.mark.parametrize("family", sorted(FAMILY_NAMES))
def test_checkpoints_resolve_to_their_family(tmp_path_factory, family):
    info = probe_model(family_checkpoint(tmp_path_factory, family))
    assert info.family.name == FAMILY_NAMES[family]
    pipelines = {
        "wan21_i2v": "WanI2VPipeline", "wan22_t2v_a14b": "Wan22T2VA14BPipeline",
        "wan22_i2v_a14b": "Wan22I2VA14BPipeline", "wan22_ti2v_5b": "Wan22TI2VPipeline",
    }  # fmt: skip
    cls = pipeline_class(info.family)  # the worker's import of the family's "module:Class"
    assert cls.__name__ == pipelines[family] and cls.__module__.startswith("distvideo.families.wan.")


def test_embedded_model_is_wan21_t2v(tiny_model):
    info = probe_model(tiny_model)
    assert info.family.name == "Wan2.1 T2V" and info.family.transformers == ("transformer",)


def test_unknown_combination_is_refused_naming_the_known_ones(tmp_path_factory, tmp_path):
    """A WanImageToVideoPipeline with one transformer, no CLIP and no per-token timesteps is no published family."""
    src = family_checkpoint(tmp_path_factory, "wan21_i2v")
    copy = tmp_path / "odd"
    shutil.copytree(src, copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["image_encoder"] = [None, None]
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"no family distvideo knows.*Wan2.1 I2V.*Wan2.2 I2V-A14B"):
        probe_model(copy)


def test_first_last_frame_checkpoint_is_refused(tmp_path_factory, tmp_path):
    copy = tmp_path / "flf2v"
    shutil.copytree(family_checkpoint(tmp_path_factory, "wan21_i2v"), copy)
    config = json.loads((copy / "transformer" / "config.json").read_text())
    (copy / "transformer" / "config.json").write_text(json.dumps({**config, "pos_embed_seq_len": 514}))
    with pytest.raises(ConfigError, match=r"Wan2\.1 FLF2V"):
        probe_model(copy)


def test_image_to_a_text_only_model_names_the_family(tiny_model, tmp_path_factory, no_weights):
    info = probe_model(tiny_model)
    image = test_image(tmp_path_factory)
    with pytest.raises(ConfigError, match=r"^image: .*Wan2.1 T2V \(WanPipeline\), a text-to-video model"):
        info.resolve_request(GenerationRequest(prompt="a fox", image=str(image)))
    t2v14 = probe_model(family_checkpoint(tmp_path_factory, "wan22_t2v_a14b"))
    with pytest.raises(ConfigError, match=r"Wan2.2 T2V-A14B"):
        t2v14.resolve_request(GenerationRequest(prompt="a fox", image=str(image)))


@pytest.mark.parametrize("family", ["wan21_i2v", "wan22_i2v_a14b"])
def test_missing_image_for_an_image_to_video_model_names_the_family(tmp_path_factory, family):
    info = probe_model(family_checkpoint(tmp_path_factory, family))
    with pytest.raises(ConfigError, match=rf"^image: .*{FAMILY_NAMES[family]} .*as image= \(a path"):
        info.resolve_request(GenerationRequest(prompt="a fox"))
    with pytest.raises(ConfigError, match=rf"^--image: .*{FAMILY_NAMES[family]} .*as --image PATH$"):
        info.resolve_request(GenerationRequest(prompt="a fox", naming=Naming("flag")))


def test_ti2v_takes_an_image_or_none(tmp_path_factory):
    info = probe_model(family_checkpoint(tmp_path_factory, "wan22_ti2v_5b"))
    assert info.resolve_request(GenerationRequest(prompt="a fox")).image is None
    resolved = info.resolve_request(GenerationRequest(prompt="a fox", image=str(test_image(tmp_path_factory))))
    assert resolved.image.dtype == np.uint8 and resolved.image.shape == (28, 40, 3)


@pytest.mark.parametrize("name", ["guidance_scale_2", "boundary_ratio"])
def test_expert_parameters_on_a_one_expert_model_name_the_family(tiny_model, name):
    with pytest.raises(ConfigError, match=rf"^{name}: .*Wan2.1 T2V .*one transformer"):
        probe_model(tiny_model).resolve_request(GenerationRequest(prompt="a fox", **{name: 0.5}))


@pytest.mark.parametrize(
    ("image", "match"),
    [
        (np.zeros((8, 8, 3), dtype=np.float32), "uint8"),
        (np.zeros((8, 8, 2), dtype=np.uint8), r"\(H, W, 3\)"),
        (np.zeros((0, 8, 3), dtype=np.uint8), "no pixels"),
        (42, "expected a file path, a PIL image or a uint8 array"),
        ("", "empty path"),
    ],
)
def test_bad_image_values_are_config_errors(image, match):
    with pytest.raises(ConfigError, match=match):
        GenerationRequest(prompt="a fox", image=image).validate()


def test_missing_or_unreadable_image_file(tmp_path_factory, tmp_path):
    info = probe_model(family_checkpoint(tmp_path_factory, "wan22_ti2v_5b"))
    with pytest.raises(ConfigError, match=r"image: '.*nothing.png' does not exist on host"):
        info.resolve_request(GenerationRequest(prompt="a fox", image=str(tmp_path / "nothing.png")))
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ConfigError, match="is not an image PIL can read"):
        info.resolve_request(GenerationRequest(prompt="a fox", image=str(tmp_path / "text.png")))
    # without reading (the CLI under a launcher): only whether the family takes an image is checked here
    assert info.resolve_request(GenerationRequest(prompt="a fox", image=str(tmp_path / "x.png")), read_image=False)


def test_family_defaults(tmp_path_factory):
    ti2v = probe_model(family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")).defaults
    assert (ti2v["num_frames"], ti2v["height"], ti2v["width"], ti2v["fps"]) == (121, 704, 1280, 24)
    t2v14 = probe_model(family_checkpoint(tmp_path_factory, "wan22_t2v_a14b"))
    resolved = t2v14.resolve_request(GenerationRequest(prompt="a fox"))
    assert (resolved.guidance_scale, resolved.guidance_scale_2, resolved.boundary_ratio) == (4.0, 3.0, 0.875)
    # as diffusers: the low-noise expert's guidance follows guidance_scale when only that is given
    resolved = t2v14.resolve_request(GenerationRequest(prompt="a fox", guidance_scale=6.0))
    assert resolved.guidance_scale_2 == 6.0
    i2v14 = probe_model(family_checkpoint(tmp_path_factory, "wan22_i2v_a14b"))
    assert i2v14.defaults["boundary_ratio"] == 0.9  # the checkpoint's model_index.json


def test_checkpoint_boundary_ratio_wins_over_the_family_value(tmp_path_factory, tmp_path):
    copy = tmp_path / "moe"
    shutil.copytree(family_checkpoint(tmp_path_factory, "wan22_t2v_a14b"), copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["boundary_ratio"] = 0.5
    (copy / "model_index.json").write_text(json.dumps(index))
    (copy / "distvideo_defaults.json").write_text(json.dumps({"guidance_scale_2": 1.5, "fps": 12}))
    info = probe_model(copy)
    assert (info.defaults["boundary_ratio"], info.defaults["guidance_scale_2"], info.defaults["fps"]) == (0.5, 1.5, 12)


def test_cli_refuses_image_for_text_only_model(tiny_model, tmp_path_factory, tmp_path, capsys, no_weights):
    image = test_image(tmp_path_factory)
    args = ["generate", "--prompt", "a fox", "--image", str(image), "--output", str(tmp_path / "v.mp4")]
    assert main(args) == 2
    assert "Wan2.1 T2V" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_missing_image_file(tmp_path_factory, tmp_path, capsys, no_weights):
    model = family_checkpoint(tmp_path_factory, "wan21_i2v")
    args = ["generate", "--model", str(model), "--prompt", "a fox", "--image", str(tmp_path / "gone.png")]
    assert main([*args, "--output", str(tmp_path / "v.mp4")]) == 2
    assert "gone.png' does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(model), "--prompt", "a fox", "--output", str(tmp_path / "v.mp4")]) == 2
    assert "Wan2.1 I2V" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_config_file_image_must_be_a_path(tmp_path):
    from distvideo.config_files import load_config_file

    (tmp_path / "c.yaml").write_text("request:\n  image: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"'request\.image' must be a file path"):
        load_config_file(tmp_path / "c.yaml")
