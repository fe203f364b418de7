"""The `compile` engine option: regional torch.compile of the transformer's repeated blocks (CompilePlan, the last
plan), frames within 2 of uncompiled, and the compile time reported apart from the denoising steps."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from distvideo import VideoGenerator
from distvideo.cli.main import main
from distvideo.config import EngineConfig
from distvideo.families.hunyuan15 import HUNYUAN15_T2V
from distvideo.families.wan import WAN22_T2V_A14B, WAN_I2V, WAN_T2V
from distvideo.models import compat
from distvideo.models.plans import CompilePlan, CpuKernelsPlan, speed_plans
from distvideo.worker import separate_compile_time

from background import FolderJob, in_a_process
from conftest import max_abs_diff

WAN = SimpleNamespace(family=WAN_T2V)
REQUEST = {"num_frames": 5, "height": 32, "width": 32, "num_inference_steps": 2, "seed": 3, "save_video": False}


def test_compile_plans_come_last_for_every_transformer():
    config = EngineConfig(compile=True, cpu_kernels=True, compact_text_padding=False).with_defaults()
    plans = speed_plans(config, SimpleNamespace(family=WAN22_T2V_A14B))
    assert [type(p) for p in plans[-2:]] == [CompilePlan, CompilePlan]
    assert [p.component for p in plans[-2:]] == ["transformer", "transformer_2"]
    assert isinstance(plans[0], CpuKernelsPlan)
    assert not any(isinstance(p, CompilePlan) for p in speed_plans(EngineConfig(compile=False).with_defaults(), WAN))


def test_compile_leaves_compact_text_padding_out():
    # the compacted text's length follows each prompt's token count: every new length would compile the blocks again
    from distvideo.families.wan.text_padding import TextPaddingPlan

    config = EngineConfig(compile=True, compact_text_padding=True, cpu_kernels=False).with_defaults()
    assert [type(p) for p in speed_plans(config, WAN)] == [CompilePlan]
    config = EngineConfig(compile=False, compact_text_padding=True, cpu_kernels=False).with_defaults()
    assert [type(p) for p in speed_plans(config, WAN)] == [TextPaddingPlan]
    # a family that declares no compact-text plan (with the reason it logs) gets none
    for family in (WAN_I2V, HUNYUAN15_T2V):
        assert speed_plans(config, SimpleNamespace(family=family)) == [], family.name


def test_compile_is_left_out_under_sequence_parallelism():
    # Ulysses' per-block hooks made the compiled blocks recompile until torch's limit of 8 graphs (measured)
    from distvideo.families.wan.text_padding import TextPaddingPlan

    config = EngineConfig(compile=True, compact_text_padding=True, cpu_kernels=False).with_defaults()
    assert [type(p) for p in speed_plans(config, WAN, sp_size=2)] == [TextPaddingPlan]


def test_compile_defaults_to_the_environment(monkeypatch):
    monkeypatch.delenv("DISTVIDEO_COMPILE", raising=False)
    assert EngineConfig().with_defaults().compile is False
    monkeypatch.setenv("DISTVIDEO_COMPILE", "1")
    assert EngineConfig().with_defaults().compile is True
    assert EngineConfig(compile=False).with_defaults().compile is False


def test_compile_plan_compiles_only_the_repeated_blocks_and_undoes(tiny_model):
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel.from_pretrained(str(tiny_model / "transformer"))
    undo = CompilePlan("transformer").apply(transformer)
    compiled = compat.compiled_modules(transformer)
    assert compiled and {type(m).__name__ for m in compiled} == {"WanTransformerBlock"}
    assert len(compiled) == len(transformer.blocks)
    undo()
    assert compat.compiled_modules(transformer) == []


def test_compile_time_leaves_the_per_step_figure():
    timings = {"denoising": 10.0, "per_step_denoising": 2.5}
    separate_compile_time(timings, 8.0, steps=4)
    assert timings == {"denoising": 10.0, "per_step_denoising": 0.5, "compile": 8.0}
    separate_compile_time(timings, -1.0, steps=4)  # dynamo's counter was reset meanwhile
    assert timings["compile"] == 0.0 and timings["per_step_denoising"] == 2.5


def test_compile_flag_in_help(capsys):
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--compile" in out and "--no-compile" in out


@pytest.mark.usefixtures("no_weights_loaded")
def test_bad_compile_value_in_the_environment_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DISTVIDEO_COMPILE", "sometimes")
    out = tmp_path / "never.mp4"
    assert main(["generate", "--prompt", "a fox", "--output", str(out), "--num-frames", "5"]) == 2
    err = capsys.readouterr().err
    assert "DISTVIDEO_COMPILE" in err and "sometimes" in err
    assert list(tmp_path.iterdir()) == []


def compile_runs(folder: Path) -> None:
    """Eager, then compiled three times (the same prompt again, another prompt): FOLDER/frames.npz and timings.json."""
    runs = {}
    with VideoGenerator.from_config(EngineConfig(executor="inline", progress=False)) as gen:
        runs["eager"] = gen.generate("a red fox in the snow", **REQUEST)
    with VideoGenerator.from_config(EngineConfig(executor="inline", compile=True, progress=False)) as gen:
        runs["first"] = gen.generate("a red fox in the snow", **REQUEST)
        runs["again"] = gen.generate("a red fox in the snow", **REQUEST)
        runs["other_prompt"] = gen.generate("a cat", **REQUEST)
    np.savez(folder / "frames.npz", **{name: run.frames for name, run in runs.items()})
    (folder / "timings.json").write_text(json.dumps({name: run.timings for name, run in runs.items()}))


# a cold Inductor compile (C++ kernels built by g++, about 20 s here) whose figures are all the test checks: in a
# process of its own, in the background (background.py)
COMPILED = FolderJob("compiled against eager", "compile", in_a_process("test_compile", "compile_runs"))
BACKGROUND_JOBS = {"compiled": COMPILED.hooks}


@pytest.fixture
def compiled() -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    folder, proc = COMPILED.result()
    assert proc.returncode == 0, proc.stderr
    frames = np.load(folder / "frames.npz")
    return {name: frames[name] for name in frames.files}, json.loads((folder / "timings.json").read_text())


@pytest.mark.slow
def test_compiled_frames_match_and_compile_time_is_reported_once_per_shape(compiled):
    frames, timings = compiled
    assert "compile" not in timings["eager"]
    assert timings["first"]["compile"] > 0
    assert timings["again"]["compile"] == 0.0  # the same shape: no recompile (dynamic=False, one graph per shape)
    assert timings["other_prompt"]["compile"] == 0.0  # nor for another prompt length (the text stays padded)
    assert max_abs_diff(frames["first"], frames["eager"]) <= 2
    assert max_abs_diff(frames["again"], frames["eager"]) <= 2
