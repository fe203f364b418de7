"""Property-based tests: bad input anywhere (request fields, CLI arguments, config files) raises ConfigError (the CLI:
exit code 2) and nothing else, never another exception or a hang; valid input passes validation. Nothing here loads
weights or generates: the CLI is only given argument lists that must be refused."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from distvideo.config import EngineConfig, LoraSpec, option_fields
from distvideo.config_files import load_config_file
from distvideo.errors import ConfigError
from distvideo.models.registry import probe_model
from distvideo.request import GenerationRequest

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# values of every type a caller, a YAML file or a JSON file can produce
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
small_ints = st.one_of(st.none(), st.integers(min_value=-5, max_value=130))
REQUEST_FIELDS = [f.name for f in option_fields(GenerationRequest) if f.name not in ("save_video", "return_frames")]


@pytest.fixture(scope="module")
def model_info(tiny_model: Path):
    return probe_model(tiny_model)


def named_field(exc: Exception) -> str:
    """The parameter a message starts with ("height=33 must be ...", "prompt: must be ..." -> height, prompt)."""
    match = re.match(r"[a-z_][a-z0-9_]*", str(exc))  # guidance_scale_2
    assert match is not None, f"the message does not start with the parameter's name: {exc}"
    return match.group(0)


def request_from(values: dict[str, Any]) -> GenerationRequest:
    return GenerationRequest(**{"prompt": "a fox", **values})


# seed and max_sequence_length are ints with defaults: None is not theirs to take (fps None: the model's)
NOT_OPTIONAL = ("seed", "max_sequence_length")


@FUZZ
@given(st.dictionaries(st.sampled_from(REQUEST_FIELDS), anything, max_size=6))
def test_request_validation_raises_only_config_error(values):
    request = request_from(values)
    try:
        request.validate()
    except ConfigError as exc:
        # the message starts with the parameter at fault, which must be one this call set (the others are defaults)
        assert named_field(exc) in values, (str(exc), values)
        return
    # accepted: every set field has a sane type
    for name in ("num_frames", "height", "width", "num_inference_steps", *NOT_OPTIONAL):
        value = getattr(request, name)
        if value is None:
            assert name not in NOT_OPTIONAL, name
            continue
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 0, name
    if request.guidance_scale is not None:
        assert math.isfinite(float(request.guidance_scale)) and request.guidance_scale >= 0


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "num_frames": small_ints,
            "height": small_ints,
            "width": small_ints,
            "num_inference_steps": small_ints,
            "guidance_scale": st.one_of(st.none(), st.floats(min_value=-2, max_value=20)),
            "seed": st.integers(min_value=-3, max_value=2**64),
            "fps": small_ints.filter(lambda v: v is not None),
            "max_sequence_length": small_ints.filter(lambda v: v is not None),
        },
    )
)
def test_resolve_request_against_the_model(model_info, values):
    """Either ConfigError, or a request with every field filled that fits the model."""
    try:
        resolved = model_info.resolve_request(request_from(values))
    except ConfigError as exc:
        assert named_field(exc) in values, (str(exc), values)
        return
    as_given = {f.name: getattr(resolved, f.name) for f in dataclasses.fields(GenerationRequest)}
    GenerationRequest(**as_given).validate()  # what resolution filled passes the model-free checks too
    assert resolved.height % model_info.spatial_stride == 0 and resolved.width % model_info.spatial_stride == 0
    assert (resolved.num_frames - 1) % model_info.vae_scale_temporal == 0
    assert all(getattr(resolved, k) is not None for k in model_info.defaults)


@FUZZ
@given(st.text(max_size=40))
def test_lora_spec_parse(text):
    try:
        spec = LoraSpec.parse(text)
    except ConfigError as exc:
        assert text == "" and str(exc).startswith("--lora: empty value")
        return
    assert spec.path and isinstance(spec.strength, float)


# --- the command line -----------------------------------------------------------------------------------------------
# Each draw breaks at least one field in a way validation must catch, so main() never gets to load weights.
INVALID_FLAGS = st.sampled_from(
    [
        ["--num-frames", "8"],
        ["--num-frames", "0"],
        ["--height", "33"],
        ["--width", "-16"],
        ["--steps", "0"],
        ["--guidance-scale", "-1"],
        ["--guidance-scale", "nan"],
        ["--seed", "-1"],
        ["--fps", "0"],
        ["--prompt", "   "],
        ["--num-gpus", "0"],
        ["--sp-size", "0"],
        ["--dist-timeout", "-3"],
        ["--dist-timeout", "inf"],
        ["--executor", "threads"],
        ["--dtype", "int8"],
        ["--executor", "inline", "--num-gpus", "2"],
        ["--executor", "mp", "--num-gpus", "2", "--sp-size", "3"],
        ["--executor", "external"],  # no launcher here
        ["--lora", ""],
        ["--height", "twelve"],
        ["--bogus-flag"],
    ]
)
# the words an error about each flag uses: the flag, or the parameter it sets
FLAG_NAMES = {
    "--num-frames": ("--num-frames", "num_frames"),
    "--height": ("--height", "height"),
    "--width": ("--width", "width"),
    "--steps": ("--steps", "num_inference_steps"),
    "--guidance-scale": ("--guidance-scale", "guidance_scale"),
    "--seed": ("--seed", "seed"),
    "--fps": ("--fps", "fps"),
    "--prompt": ("--prompt", "prompt"),
    "--num-gpus": ("--num-gpus", "num_gpus"),
    "--sp-size": ("--sp-size", "sp_size", "sp("),
    "--dist-timeout": ("--dist-timeout", "dist_timeout"),
    "--executor": ("--executor", "executor"),
    "--dtype": ("--dtype", "dtype"),
    "--lora": ("--lora",),
}
ANY_FLAGS = st.lists(
    st.tuples(
        st.sampled_from(["--num-frames", "--height", "--width", "--steps", "--guidance-scale", "--seed", "--fps"]),
        st.one_of(st.integers(min_value=-40, max_value=200).map(str), st.sampled_from(["", "x", "1e3", "-0", "nan"])),
    ),
    max_size=4,
)


@FUZZ
@given(valid_looking=ANY_FLAGS, broken=INVALID_FLAGS, broken_first=st.booleans())
def test_cli_refuses_invalid_arguments_with_exit_2(valid_looking, broken, broken_first, no_weights_loaded, capsys):
    from distvideo.cli.main import main

    flags = [part for name, value in valid_looking if name not in broken for part in (name, value)]  # last one wins
    argv = ["generate", "--prompt", "a fox", *(broken + flags if broken_first else flags + broken)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "distvideo: error:" in err and "Traceback" not in err
    # the error names one of the parameters given (the broken one, or a valid-looking one that was invalid too)
    given = {name for name in argv if name.startswith("--")}
    named = {word for flag in given for word in FLAG_NAMES.get(flag, (flag,))}
    assert any(word in err for word in named), (err, argv)


@FUZZ
@given(ANY_FLAGS)
def test_cli_arguments_validate_or_raise_config_error(model_info, pairs):
    """Any argument list: parsing and validation (no generation) end in ConfigError / exit 2 or a valid request."""
    from distvideo.cli.main import build_parser, configs_from_args

    argv = ["generate", "--prompt", "a fox", *[part for pair in pairs for part in pair]]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2
        return
    try:
        engine, request = configs_from_args(args)
        model_info.resolve_request(request)
    except ConfigError:
        return
    engine.validate()


# --- config files ---------------------------------------------------------------------------------------------------
ENGINE_KEYS = [*(f.name for f in option_fields(EngineConfig)), "num_gpu", "Executor", "naming"]  # (naming: no option)
REQUEST_KEYS = [*REQUEST_FIELDS, "steps", "prompts"]
sections = st.fixed_dictionaries(
    {},
    optional={
        "engine": st.one_of(
            anything, st.dictionaries(st.sampled_from(ENGINE_KEYS), anything | st.lists(anything), max_size=4)
        ),
        "request": st.one_of(anything, st.dictionaries(st.sampled_from(REQUEST_KEYS), anything, max_size=5)),
        "extra": anything,
    },
)


def check_config_file(path: Path) -> None:
    """A file is refused naming itself (`--config PATH: ...`), or its values are refused naming a key the file set,
    or it is valid."""
    try:
        values = load_config_file(path)
    except ConfigError as exc:
        assert str(exc).startswith(f"--config {path}: "), str(exc)
        return
    for section, cls, defaults in (("engine", EngineConfig, {}), ("request", GenerationRequest, {"prompt": "x"})):
        try:
            cls(**{**defaults, **values[section]}).validate()
        except ConfigError as exc:
            assert named_field(exc) in values[section], (str(exc), values[section])
            return


@FUZZ
@given(data=sections, as_json=st.booleans())
def test_config_file_mappings(tmp_path, data, as_json):
    path = tmp_path / ("c.json" if as_json else "c.yaml")
    try:
        text = json.dumps(data, allow_nan=True) if as_json else yaml.safe_dump(data)
    except (TypeError, ValueError, yaml.YAMLError):
        assume(False)
    path.write_text(text)
    check_config_file(path)


@FUZZ
@given(data=st.one_of(st.text(max_size=80), st.binary(max_size=80)), suffix=st.sampled_from([".yaml", ".json", ".yml"]))
def test_config_file_arbitrary_text(tmp_path, data, suffix):
    path = tmp_path / f"c{suffix}"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    check_config_file(path)


def deep_config(tmp_path: Path, suffix: str, depth: int) -> Path:
    path = tmp_path / f"deep{suffix}"
    nested = "[" * depth + "]" * depth
    path.write_text('{"engine": ' + nested + "}" if suffix == ".json" else "engine: " + nested)
    return path


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_file_nested_lists(tmp_path, suffix):
    with pytest.raises(ConfigError, match="'engine' must be a mapping"):
        load_config_file(deep_config(tmp_path, suffix, 50))


# --- gaps the fuzzing found in distvideo/config.py, fixed there ---
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_file_nested_too_deep_is_a_config_error(tmp_path, suffix):
    with pytest.raises(ConfigError):
        load_config_file(deep_config(tmp_path, suffix, 5000))


def test_request_seed_none_is_a_config_error():
    with pytest.raises(ConfigError, match="seed"):
        GenerationRequest(prompt="x", seed=None).validate()


def test_request_none_for_a_plain_int_is_a_config_error():
    with pytest.raises(ConfigError, match="max_sequence_length"):
        GenerationRequest(prompt="x", max_sequence_length=None).validate()


def test_engine_infinite_dist_timeout_is_a_config_error():
    with pytest.raises(ConfigError, match="dist_timeout"):
        EngineConfig(dist_timeout=float("inf")).validate()
