"""Bad configuration is refused early, with exit code 2 (bad input) or 1 (runtime) and a message naming the file or key.

Config files that do not parse or hold unknown keys, impossible parallel layouts, and model folders with missing,
truncated or garbled files, or a shard their index lists missing, are refused before any process starts or weight
loads (the `no_weights_loaded` tripwire fails the test if weights load); a tokenizer that parses but does not load fails at load time (exit 1)
naming its folder. See docs/reliability.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from distvideo.cli.main import main

from background import foreground_children

SMALL = ["--num-frames", "5", "--height", "32", "--width", "32", "--steps", "1"]


@pytest.fixture
def model_copy(tmp_path: Path, tiny_model: Path) -> Path:
    """A copy of the embedded tiny model that a test may damage."""
    return Path(shutil.copytree(tiny_model, tmp_path / "tiny-wan"))


def generate(args: list[str], tmp_path: Path) -> int:
    return main(["generate", "--prompt", "a fox", "--output", str(tmp_path / "out" / "v.mp4"), *SMALL, *args])


# --- config files ---------------------------------------------------------------------------------------------------
CONFIG_FILES = [
    ("bad.yaml", "engine: [unclosed\n", "cannot parse"),
    ("bad.json", '{"engine": {"sp_size": 1,}}', "cannot parse"),
    ("latin1.yaml", b"request:\n  prompt: caf\xe9\n", "cannot parse"),
    ("top.yaml", "engin:\n  sp_size: 1\n", "unknown key 'engin'"),
    ("nested.yaml", "request:\n  num_frame: 5\n", "unknown key 'request.num_frame'"),
    ("type.json", '{"engine": {"num_gpus": "two"}}', "'engine.num_gpus' must be int"),
    ("list.yaml", "- engine\n- request\n", "expected a mapping"),
]


@pytest.mark.parametrize(("name", "content", "expected"), CONFIG_FILES, ids=[c[0] for c in CONFIG_FILES])
def test_bad_config_file_exits_2_naming_file_and_key(name, content, expected, tmp_path, capsys, no_weights_loaded):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert generate(["--config", str(path)], tmp_path) == 2
    err = capsys.readouterr().err
    assert f"--config {path}" in err and expected in err, err
    assert not (tmp_path / "out").exists()


# --- impossible layouts ---------------------------------------------------------------------------------------------
def test_impossible_layout_on_mp_exits_2_before_any_process(tmp_path, capsys, no_weights_loaded):
    before = {p.pid for p in foreground_children()}  # not a background job's (tests/background.py)
    assert generate(["--executor", "mp", "--num-gpus", "2", "--sp-size", "3"], tmp_path) == 2
    err = capsys.readouterr().err
    assert "sp(3)" in err and "world_size(2)" in err and "sp_size=" in err, err  # the arithmetic and what would work
    assert {p.pid for p in foreground_children()} - before == set()


def test_impossible_layout_under_a_launcher_exits_2_before_the_rendezvous(
    tmp_path, capsys, monkeypatch, no_weights_loaded
):
    """What each of 2 launched ranks sees with --sp-size 3: refused before init_process_group (no rank waits)."""
    import torch.distributed

    def no_rendezvous(*args, **kwargs):
        raise AssertionError("joined the rendezvous with an impossible layout")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_rendezvous)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert generate(["--sp-size", "3"], tmp_path) == 2
    err = capsys.readouterr().err
    assert "sp(3)" in err and "world_size(2)" in err, err


# --- damaged model folders ------------------------------------------------------------------------------------------
def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"#" * 32  # the JSON header starts after its 8-byte length
    path.write_bytes(bytes(data))


def shard_then_drop_one(path: Path) -> None:
    """Split a component's weights into two shards with the index diffusers writes, then lose the second shard."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    names = sorted(tensors)
    halves = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[: len(names) // 2]}
    halves["diffusion_pytorch_model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(path.parent / shard))
        weight_map |= dict.fromkeys(keys, shard)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    (path.parent / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps(index | {"weight_map": weight_map})
    )
    path.unlink()
    (path.parent / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()


DAMAGE = [
    ("transformer-truncated", "transformer/diffusion_pytorch_model.safetensors", truncate, "is corrupt or truncated"),
    ("vae-garbled", "vae/diffusion_pytorch_model.safetensors", garble_header, "invalid JSON in header"),
    ("text-encoder-missing", "text_encoder/model.safetensors", Path.unlink, "has no weight file"),
    (
        "transformer-shard-missing",
        "transformer/diffusion_pytorch_model.safetensors",
        shard_then_drop_one,
        "lists shard(s) that are missing: diffusion_pytorch_model-00002-of-00002.safetensors",
    ),
    ("tokenizer-garbled", "tokenizer/tokenizer.json", truncate, "is not valid JSON"),
    ("scheduler-garbled", "scheduler/scheduler_config.json", garble_header, "is not valid JSON"),
]


@pytest.mark.parametrize(("case", "relpath", "damage", "expected"), DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_model_folder_exits_2_naming_the_file(
    case, relpath, damage, expected, model_copy, tmp_path, capsys, no_weights_loaded
):
    target = model_copy / relpath
    damage(target)
    assert generate(["--model", str(model_copy)], tmp_path) == 2
    err = capsys.readouterr().err
    named = str(target) if target.exists() else str(target.parent)
    assert named in err and expected in err and "re-download" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("no_weights_loaded")
def test_damaged_model_folder_is_refused_by_the_api_too(model_copy):
    from distvideo import VideoGenerator
    from distvideo.errors import ConfigError

    truncate(model_copy / "vae" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ConfigError, match=r"vae/diffusion_pytorch_model\.safetensors is corrupt or truncated"):
        VideoGenerator.from_pretrained(model_copy, executor="inline")


def test_tokenizer_that_parses_but_does_not_load_exits_1_naming_it(model_copy, tmp_path, capsys):
    """Valid JSON, but not a tokenizer: only loading can tell, so this is a runtime failure (exit 1)."""
    (model_copy / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    assert generate(["--model", str(model_copy)], tmp_path) == 1
    err = capsys.readouterr().err
    assert "ModelLoadError: cannot load the tokenizer" in err and str(model_copy / "tokenizer") in err, err
    assert not (tmp_path / "out").exists()
