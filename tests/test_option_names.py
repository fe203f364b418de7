"""Each option answers to its flag and its key everywhere (config.ALIASES: `--steps` / `steps` for
num_inference_steps, `--output` / `output` for output_path), and an error names the option as its user gave it: the
flag on the command line, the key in a config file or a prompt file, the keyword in the Python API, the body's field
over HTTP, with no path of the server in an HTTP error (issue 55). All in this process, before any weight loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from distvideo import VideoGenerator
from distvideo.batch.items import build_items
from distvideo.cli.main import build_parser, configs_from_args, main
from distvideo.config import EngineConfig
from distvideo.errors import ConfigError
from distvideo.executors.select import resolve_external_env
from distvideo.models.registry import probe_model
from distvideo.request import GenerationRequest
from distvideo.serving.admission import Admission, ApiError
from distvideo.serving.options import ServeLimits
from distvideo.serving.schemas import VideoCreate

TINY = Path(__file__).resolve().parents[1] / "src" / "distvideo" / "assets" / "tiny-wan"
SMALL = ["--num-frames", "5", "--height", "32", "--width", "32"]
TORCHRUN_OF_2 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"}
TORCHRUN_OF_2["MASTER_PORT"] = "29500"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def parsed(*argv: str):
    return configs_from_args(build_parser().parse_args(["generate", *argv]))


# -- one option, its flag and its key ------------------------------------------------------------------------------
def test_a_config_file_takes_the_flags_names_as_keys(tmp_path):
    path = write(tmp_path, "request:\n  prompt: a fox\n  steps: 3\n  output: fox.mp4\n")
    _, request = parsed("--config", str(path))
    assert (request.num_inference_steps, request.output_path) == (3, "fox.mp4")


def test_the_command_line_takes_the_fields_names_as_flags():
    _, request = parsed("--prompt", "a fox", "--num-inference-steps", "3", "--output-path", "fox.mp4")
    assert (request.num_inference_steps, request.output_path) == (3, "fox.mp4")


def test_one_option_given_by_two_of_its_keys_is_refused(tmp_path):
    path = write(tmp_path, "request:\n  steps: 3\n  num_inference_steps: 4\n")
    with pytest.raises(ConfigError, match=r"'request\.steps' and 'request\.num_inference_steps' are the same option"):
        parsed("--config", str(path))


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        ("request:\n  num_frame: 5\n", "did you mean 'request.num_frames'?"),
        ("request:\n  step: 5\n", "did you mean 'request.steps'?"),
        ("engine:\n  num_gpu: 2\n", "did you mean 'engine.num_gpus'?"),
        ("engin:\n  num_gpus: 2\n", "did you mean 'engine'?"),
    ],
)
def test_an_unknown_config_key_suggests_the_nearest_known_one(tmp_path, text, suggestion):
    with pytest.raises(ConfigError, match="unknown key") as info:
        parsed("--config", str(write(tmp_path, text)))
    assert suggestion in str(info.value), str(info.value)


def test_an_unknown_engine_option_in_the_api_suggests_the_nearest_one():
    with pytest.raises(ConfigError, match=r"num_gpu: not an engine option \(did you mean 'num_gpus'\?\)"):
        VideoGenerator.from_pretrained(num_gpu=2)


# -- errors name the option as it was given -----------------------------------------------------------------------
@pytest.mark.usefixtures("no_weights_loaded")
@pytest.mark.parametrize(
    ("argv", "config", "message"),
    [
        (["--height", "100000"], None, "--height 100000 must be <= 8192"),
        (["--steps", "0"], None, "--steps 0 must be >= 1"),
        (["--num-inference-steps", "0"], None, "--num-inference-steps 0 must be >= 1"),
        (["--height", "40"], None, "--height 40 must be a multiple of 16"),
        ([], "request:\n  height: 100000\n", "--config {cfg}: request.height=100000 must be <= 8192"),
        ([], "request:\n  steps: 0\n", "--config {cfg}: request.steps=0 must be >= 1"),
        ([], "request:\n  num_frames: 6\n", "--config {cfg}: request.num_frames=6 must be of the form 4k+1"),
        (["--height", "40"], "request:\n  height: 100000\n", "--height 40 must be a multiple of 16"),
        ([], "engine:\n  device: banana\n", "--config {cfg}: engine.device='banana' is not a device"),
        (["--cache", "mag", "--steps", "7"], None, "--cache mag: tiny-wan has no MagCache ratios for 7 steps"),
    ],
    ids=[
        "flag",
        "short-flag",
        "long-flag",
        "flag-model",
        "key",
        "alias-key",
        "key-model",
        "flag-over-key",
        "engine-key",
        "cache",
    ],
)
def test_the_command_line_names_the_flag_or_the_config_key_that_was_given(tmp_path, capsys, argv, config, message):
    cfg = write(tmp_path, config) if config else None
    given = ["--config", str(cfg)] if cfg else []
    small = [] if config and config.startswith("request") else SMALL  # (flags override the file)
    code = main(["generate", "--prompt", "a fox", "--output", str(tmp_path / "o.mp4"), *small, *given, *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(cfg=cfg) in err, err
    assert "(--" not in err and "num_inference_steps" not in err, err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"height": 100000}, "height=100000 must be <= 8192"),
        ({"num_inference_steps": 0}, "num_inference_steps=0 must be >= 1"),
        ({"cache": "teacache"}, "cache='teacache': unknown method"),
        ({"output_path": "a\0b.mp4"}, "output_path="),
    ],
)
def test_the_api_names_the_keyword_and_the_error_carries_the_field(fields, message):
    with pytest.raises(ConfigError) as info:
        GenerationRequest(prompt="a fox", **fields).validate()
    assert str(info.value).startswith(message) and "--" not in str(info.value), str(info.value)
    assert info.value.param == next(iter(fields))


def test_a_world_size_that_disagrees_with_the_launcher_is_named_as_given(tmp_path):
    """Before: `pass num_gpus=2` whoever asked, the Python keyword to a user of the command line."""
    cases = {
        "--num-gpus 3 but the launcher (torchrun) started 2 processes; give --num-gpus 2": parsed(
            "--prompt", "x", "--num-gpus", "3"
        )[0],
        "num_gpus=3 but the launcher (torchrun) started 2 processes; give num_gpus=2": EngineConfig(num_gpus=3),
        "--config {cfg}: engine.num_gpus=3 but the launcher (torchrun) started 2 processes; give --num-gpus 2": parsed(
            "--prompt", "x", "--config", str(write(tmp_path, "engine:\n  num_gpus: 3\n"))
        )[0],
    }
    for message, config in cases.items():
        with pytest.raises(ConfigError) as info:
            resolve_external_env(config, TORCHRUN_OF_2)
        assert str(info.value).startswith(message.format(cfg=tmp_path / "c.yaml")), str(info.value)
        assert info.value.param == "num_gpus"


def test_a_prompt_file_item_takes_the_aliases_and_its_errors_name_its_keys():
    model = probe_model(TINY)
    _, defaults = parsed("--prompt", "-", *SMALL)  # as `generate --prompts` reads its flags
    raw = [{"prompt": "a", "steps": 2}, {"prompt": "b", "steps": 0}, {"prompt": "c", "num_frame": 5}]
    ok, bad_steps, unknown = build_items(raw, model, defaults=defaults)
    assert ok.error is None and ok.request is not None and ok.request.num_inference_steps == 2
    assert bad_steps.error is not None and bad_steps.error.startswith("steps=0 must be >= 1"), bad_steps.error
    assert unknown.error is not None and "did you mean 'num_frames'?" in unknown.error, unknown.error


# -- HTTP: the body's field in `param`, and no path of the server -------------------------------------------------
def test_an_http_refusal_names_the_field_and_no_server_path(tmp_path):
    """Before: 422 for an uncalibrated `cache: mag` told the client to run `distvideo calibrate --model <the server's
    model folder>`."""
    model = probe_model(TINY)
    admission = Admission(model=model, model_id="tiny-wan", limits=ServeLimits(), output=tmp_path)
    body = VideoCreate(prompt="a fox", size="32x32", num_frames=5, num_inference_steps=7, cache="mag")
    with pytest.raises(ApiError) as info:
        admission.admit(body, "video_1")
    error = info.value
    assert (error.status, error.param) == (422, "cache"), error.message
    assert str(TINY) not in error.message and str(tmp_path) not in error.message, error.message
    assert "--" not in error.message.replace("`distvideo calibrate --steps 7`", ""), error.message
    assert "operator" in error.message and '"cache": "first-block"' in error.message, error.message
