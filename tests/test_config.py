"""Config files are strict (unknown keys name their dotted path) and flags override the file."""

from __future__ import annotations

import pytest

from distvideo.cli.main import build_parser, configs_from_args
from distvideo.config import LoraSpec
from distvideo.config_files import load_config_file
from distvideo.errors import ConfigError
from distvideo.request import GenerationRequest


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_unknown_key_names_dotted_path(tmp_path):
    p = write(tmp_path, "request:\n  prompt: hi\n  num_frame: 17\n")
    with pytest.raises(ConfigError, match=r"request\.num_frame"):
        load_config_file(p)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="'engin'"):
        load_config_file(write(tmp_path, "engin:\n  model: x\n"))


def test_wrong_type_names_key_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"request\.height.*must be int.*'tall'"):
        load_config_file(write(tmp_path, "request:\n  height: tall\n"))


@pytest.mark.parametrize("item", ["''", "'transformer_2='"], ids=["empty", "target-only"])
def test_a_bad_lora_string_in_the_file_names_the_file_and_the_key(tmp_path, item):
    """Found by test_fuzz.py's config-file property: an empty adapter string in `engine.lora` was refused with the
    `--lora` flag's message, naming neither the file nor the key."""
    p = write(tmp_path, f"engine:\n  lora: [x.safetensors, {item}]\n")
    with pytest.raises(ConfigError) as info:
        load_config_file(p)
    assert str(info.value).startswith(f"--config {p}: 'engine.lora[1]': empty value"), str(info.value)


def test_unparseable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config_file(write(tmp_path, "request: [unclosed\n"))


def test_json_file(tmp_path):
    cfg = load_config_file(write(tmp_path, '{"engine": {"num_gpus": 2}, "request": {"seed": 5}}', "c.json"))
    assert cfg == {"engine": {"num_gpus": 2}, "request": {"seed": 5}}


def test_flags_override_file(tmp_path):
    p = write(
        tmp_path,
        "engine:\n  executor: inline\n  dist_timeout: 60\n  lora: ['a.safetensors:0.5']\n"
        "request:\n  prompt: from file\n  seed: 1\n  height: 32\n  guidance_scale: 3\n",
    )
    args = build_parser().parse_args(["generate", "--config", str(p), "--seed", "9", "--prompt", "from flag"])
    engine, request = configs_from_args(args)
    assert engine.executor == "inline" and engine.dist_timeout == 60.0
    assert engine.lora == [LoraSpec("a.safetensors", 0.5)]
    assert (request.prompt, request.seed, request.height, request.guidance_scale) == ("from flag", 9, 32, 3.0)


def test_file_values_apply_when_no_flag(tmp_path):
    p = write(tmp_path, "request:\n  prompt: only in file\n  num_frames: 9\n")
    _, request = configs_from_args(build_parser().parse_args(["generate", "--config", str(p)]))
    assert (request.prompt, request.num_frames) == ("only in file", 9)


def test_missing_prompt_is_config_error():
    with pytest.raises(ConfigError, match="--prompt"):
        configs_from_args(build_parser().parse_args(["generate"]))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a.safetensors", ("a.safetensors", 1.0)),
        ("a.safetensors:0.7", ("a.safetensors", 0.7)),
        ("C:/x.st:2", ("C:/x.st", 2.0)),
    ],
)
def test_lora_spec_parse(text, expected):
    spec = LoraSpec.parse(text)
    assert (spec.path, spec.strength) == expected


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt": ""}, "prompt"),
        ({"num_frames": 0}, "num_frames"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"guidance_scale": -0.5}, "guidance_scale"),
        ({"seed": -1}, "seed"),
        ({"fps": 0}, "fps"),
        ({"height": 1.5}, "height"),
    ],
)
def test_request_validation_names_parameter(fields, named):
    req = GenerationRequest(**{"prompt": "ok", **fields})
    with pytest.raises(ConfigError, match=named):
        req.validate()
