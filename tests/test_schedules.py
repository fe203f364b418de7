"""Few-step models (issue 52): a checkpoint's declared schedule, --scheduler / --flow-shift / --timesteps / --sigmas,
and guidance-free requests that run one branch; frames against diffusers' WanPipeline built with the same scheduler
class and settings (constructed here from diffusers' own documented arguments, not through distvideo)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from distvideo import VideoGenerator
from distvideo.cli.main import main
from distvideo.config import EngineConfig, Naming
from distvideo.errors import ConfigError
from distvideo.executors import resolve_engine
from distvideo.models.registry import probe_model
from distvideo.request import GenerationRequest
from distvideo.testing.distilled import (
    FASTWAN_FLOW_SHIFT,
    FASTWAN_TIMESTEPS,
    LIGHTX2V_LORA_RANK,
    LIGHTX2V_STEP_DISTILL,
    build_fastwan_style,
    build_step_distill_lora,
)
from launch_groups import torchrun_case
from rank_scripts.few_step_ranks import LORA_REQUEST
from rank_scripts.few_step_ranks import PROMPT as RANKS_PROMPT

from conftest import diffusers_frames, diffusers_pipeline, max_abs_diff

SMALL = dict(num_frames=5, height=32, width=48)


@pytest.fixture(scope="module")
def fastwan(tmp_path_factory):
    return build_fastwan_style(tmp_path_factory.mktemp("distilled") / "fastwan")


def _counting(gen: VideoGenerator) -> dict[str, int]:
    """Counts the transformer's forwards and the text encodings of an inline generator's pipeline."""
    pipeline = gen.executor.worker.pipeline
    counts = {"forwards": 0, "texts": 0}
    pipeline.transformer.register_forward_pre_hook(lambda *_: counts.__setitem__("forwards", counts["forwards"] + 1))
    pipeline.text_encoder.register_forward_pre_hook(lambda *_: counts.__setitem__("texts", counts["texts"] + 1))
    return counts


def _reference(model, prompt: str, *, scheduler=None, sigmas=None, lora=None, **kwargs):
    """diffusers' WanPipeline frames (uint8, conftest.diffusers_frames) with `scheduler` put in, and `sigmas` passed
    to its set_timesteps (the pipeline's __call__ takes no timesteps)."""
    pipe = diffusers_pipeline(model)
    if lora is not None:
        pipe.load_lora_weights(str(lora), adapter_name="distill")
    if scheduler is not None:
        pipe.scheduler = scheduler
    if sigmas is not None:
        set_timesteps = pipe.scheduler.set_timesteps
        given = np.asarray(sigmas, dtype=np.float64)  # an array: diffusers' UniPC shifts no Python list
        pipe.scheduler.set_timesteps = lambda steps, device=None: set_timesteps(sigmas=given, device=device)
    return diffusers_frames(pipe, prompt, **kwargs)


def _fastwan_reference(fastwan, prompt: str, *, seed: int):
    """diffusers' frames for the FastWan-style checkpoint's declared request: 3 steps at its timesteps, no guidance."""
    return _reference(
        fastwan,
        prompt,
        sigmas=[t / 1000 for t in FASTWAN_TIMESTEPS],
        seed=seed,
        num_frames=17,
        height=64,
        width=64,
        num_inference_steps=len(FASTWAN_TIMESTEPS),
        guidance_scale=1.0,
    )


def test_a_distilled_checkpoint_runs_its_declared_schedule_in_one_branch_as_diffusers(fastwan):
    with VideoGenerator.from_pretrained(fastwan, executor="inline") as gen:
        counts = _counting(gen)
        res = gen.generate("a red fox running through snow", seed=7, save_video=False)
        request = gen.model_info.resolve_request(GenerationRequest(prompt="x"))
    assert (request.num_inference_steps, request.guidance_scale) == (3, 1.0)
    assert request.timesteps == FASTWAN_TIMESTEPS
    assert counts == {"forwards": 3, "texts": 1}  # one branch: no unconditional text, no second forward
    ref = _fastwan_reference(fastwan, "a red fox running through snow", seed=7)
    assert res.frames.std() > 1.0, "flat frames would prove nothing"
    assert max_abs_diff(res.frames, ref) <= 2


def test_each_scheduler_shift_and_list_matches_diffusers(tiny_model):
    """The embedded model ships FlowMatchEuler (shift 3); each option against the scheduler diffusers' docs build."""
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    flow = dict(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000)
    cases = [
        (dict(scheduler="unipc"), UniPCMultistepScheduler(flow_shift=3.0, **flow), None),
        (dict(scheduler="dpm", flow_shift=5.0), DPMSolverMultistepScheduler(flow_shift=5.0, **flow), None),
        (dict(flow_shift=7.0), FlowMatchEulerDiscreteScheduler(shift=7.0), None),
        (dict(timesteps=[1000, 800, 400]), None, [1.0, 0.8, 0.4]),
        (dict(scheduler="unipc", sigmas=[0.9, 0.6, 0.3]), UniPCMultistepScheduler(flow_shift=3.0, **flow), None),
    ]
    with VideoGenerator.from_pretrained(tiny_model, executor="inline") as gen:
        counts = _counting(gen)
        for options, scheduler, sigmas in cases:
            listed = any(k in options for k in ("timesteps", "sigmas"))  # a list sets the steps
            steps = 3 if listed else 4
            given = {} if listed else {"num_inference_steps": steps}
            res = gen.generate(
                "waves at dusk", seed=2, guidance_scale=4.0, save_video=False, **SMALL, **options, **given
            )
            ref = _reference(
                tiny_model,
                "waves at dusk",
                scheduler=scheduler,
                sigmas=sigmas or options.get("sigmas"),
                seed=2,
                num_inference_steps=steps,
                guidance_scale=4.0,
                **SMALL,
            )
            assert max_abs_diff(res.frames, ref) <= 2, options
    assert counts["forwards"] == 2 * (4 + 4 + 4 + 3 + 3)  # guided: two forwards a step


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(scheduler="ddim"), "--scheduler"),
        (dict(flow_shift=0.0), "--flow-shift"),
        (dict(timesteps=[250, 500]), "--timesteps"),
        (dict(timesteps=[1000, 500], num_inference_steps=4), "--timesteps"),
        (dict(timesteps=[2000, 500]), "--timesteps"),
        (dict(sigmas=[1.5, 0.5]), "--sigmas"),
        (dict(sigmas=[1.0, 0.5], timesteps=[1000, 500]), "--sigmas"),
        (dict(scheduler="dpm", timesteps=[1000, 500]), "--timesteps"),
    ],
    ids=["unknown", "shift", "increasing", "length", "range", "sigma-range", "both", "dpm-list"],
)
@pytest.mark.usefixtures("no_weights_loaded")
def test_bad_schedules_are_refused_naming_the_option(tiny_model, options, named):
    model = probe_model(tiny_model)
    with pytest.raises(ConfigError) as err:
        model.resolve_request(GenerationRequest(prompt="x", naming=Naming("flag"), **options))
    assert str(err.value).startswith(named), str(err.value)


@pytest.mark.usefixtures("no_weights_loaded")
def test_the_cli_refuses_a_bad_list_with_exit_2(capsys):
    assert main(["generate", "--prompt", "x", "--timesteps", "1000,x"]) == 2
    assert "--timesteps" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--timesteps", "500,1000", "--no-progress"]) == 2
    assert "--timesteps 500,1000: must be strictly decreasing" in capsys.readouterr().err


def test_a_declared_schedule_is_checked_and_yields_to_the_request(fastwan, tmp_path):
    model = probe_model(fastwan)
    # the request's own step count drops the declared list: the scheduler spaces 8 steps with the declared shift
    eight = model.resolve_request(GenerationRequest(prompt="x", num_inference_steps=8))
    assert (eight.num_inference_steps, eight.timesteps) == (8, None)
    assert model.schedule(eight).config["shift"] == FASTWAN_FLOW_SHIFT
    assert model.resolve_request(GenerationRequest(prompt="x", scheduler="dpm")).timesteps is None  # takes no list
    # a list of its own sets the steps
    mine = model.resolve_request(GenerationRequest(prompt="x", sigmas=[1.0, 0.5]))
    assert (mine.num_inference_steps, mine.timesteps, mine.sigmas) == (2, None, [1.0, 0.5])
    broken = tmp_path / "broken"
    shutil.copytree(fastwan, broken)
    declared = json.loads((broken / "distvideo_defaults.json").read_text())
    (broken / "distvideo_defaults.json").write_text(json.dumps({**declared, "timesteps": [522, 757, 1000]}))
    with pytest.raises(ConfigError, match=r"distvideo_defaults.json: timesteps.*strictly decreasing"):
        probe_model(broken)


def test_generate_runs_the_4_step_demo_model_by_name_from_its_declaration(tmp_path, capsys):
    """`distvideo generate --model demo-4step --prompt ...`: the shipped distilled model, its declared schedule."""
    out = tmp_path / "ball.mp4"
    argv = ["generate", "--model", "demo-4step", "--prompt", "a red ball moving right on a black background"]
    assert main([*argv, "--output", str(out), "--no-progress", "--executor", "inline"]) == 0
    assert out.stat().st_size > 0
    from distvideo.models.embedded import DEMO_4STEP_MODEL_DIR

    request = probe_model(DEMO_4STEP_MODEL_DIR).resolve_request(GenerationRequest(prompt="x"))
    assert (request.num_inference_steps, request.guidance_scale, request.scheduler) == (4, 1.0, "euler")


def test_a_guidance_free_checkpoint_gets_no_cfg_degree_on_any_path(fastwan, tiny_model):
    """generate plans for latency, batch and serve for throughput, and the fixed rules apply where a layout option is
    given: none splits a guidance-free checkpoint into CFG halves; the guided model on the same world still gets them."""
    for objective in ("latency", "throughput"):
        for extra in ({}, {"layout": "rules"}, {"sp_size": 2}):
            config = EngineConfig(model=str(fastwan), num_gpus=4, executor="mp", device="cpu", **extra)
            assert resolve_engine(config, environ={}, objective=objective).layout.cfg_degree == 1, (objective, extra)
    guided = EngineConfig(model=str(tiny_model), num_gpus=4, executor="mp", device="cpu", layout="rules")
    assert resolve_engine(guided, environ={}).layout.cfg_degree == 2


def _lora_reference(tiny_model, lora, prompt: str, *, seed: int, **request):
    from diffusers import FlowMatchEulerDiscreteScheduler

    schedule = LIGHTX2V_STEP_DISTILL
    return _reference(
        tiny_model,
        prompt,
        lora=lora,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=schedule["flow_shift"]),
        sigmas=[t / 1000 for t in schedule["timesteps"]],
        seed=seed,
        num_inference_steps=4,
        guidance_scale=1.0,
        **request,
    )


def test_a_lightx2v_named_step_distill_lora_runs_its_schedule_as_diffusers(tiny_model, tmp_path):
    """LightX2V's key naming (diffusion_model.blocks.N.self_attn.q.lora_down.weight), rank 32, alpha 32, with the
    schedule its config gives, against diffusers loading the same file (its converter for the original Wan keys)."""
    from safetensors import safe_open

    lora = build_step_distill_lora(tiny_model, tmp_path / "lightx2v_rank32.safetensors")
    with safe_open(str(lora), "pt") as f:
        keys = list(f.keys())
        assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in keys
        assert f.get_tensor("diffusion_model.blocks.0.self_attn.q.lora_down.weight").shape[0] == LIGHTX2V_LORA_RANK
    schedule = LIGHTX2V_STEP_DISTILL
    with VideoGenerator.from_pretrained(tiny_model, executor="inline", lora=[str(lora)]) as gen:
        counts = _counting(gen)
        res = gen.generate("a cat on a sofa", seed=4, save_video=False, **SMALL, **schedule)
    assert counts == {"forwards": 4, "texts": 1}
    ref = _lora_reference(tiny_model, lora, "a cat on a sofa", seed=4, **SMALL)
    assert max_abs_diff(res.frames, ref) <= 2


def _torchrun_argv(folder, environ):
    return [str(Path(__file__).parent / "rank_scripts" / "few_step_ranks.py"), str(folder / "out")]


# in the background, in turn with other modules' 2-rank scripts (launch_groups.py)
LAUNCH = torchrun_case("a guidance-free checkpoint at sp2 and as replicas", 2, _torchrun_argv, timeout=300)
BACKGROUND_JOBS = {"launched": LAUNCH.hooks}
launched = LAUNCH.fixture("launched")


@pytest.mark.launcher
@pytest.mark.slow
def test_under_torchrun_the_engine_picks_one_branch_and_matches_diffusers(launched, fastwan, tiny_model, tmp_path):
    """The layout the engine picks for a declared guidance of 1 on 2 ranks (sequence parallel, no CFG halves), and
    two replicas, each within 2 of diffusers' frames for the declared schedule; the step-distill LoRA at sp 2 and as two
    replicas, within 2 of diffusers with the LoRA (the file the ranks built: the builder is deterministic)."""
    from launchers import format_output

    folder, proc = launched
    assert proc.returncode == 0, format_output(proc)
    layouts = json.loads((folder / "out" / "layouts.json").read_text())
    assert layouts == {
        "sp": "world 2 = cfg 1 x sp 2",
        "replicas": "world 2 = replicas 2 x cfg 1 x sp 1",
        "lora": "world 2 = cfg 1 x sp 2",
        "lora-replicas": "world 2 = replicas 2 x cfg 1 x sp 1",
    }, layouts
    ref = _fastwan_reference(fastwan, RANKS_PROMPT, seed=7)
    for name in ("sp", "replicas"):
        assert max_abs_diff(np.load(folder / "out" / f"{name}.npy"), ref) <= 2, name
    lora = build_step_distill_lora(tiny_model, tmp_path / "lightx2v.safetensors")
    assert lora.read_bytes() == (folder / "out" / "rank0" / "lightx2v.safetensors").read_bytes()
    request = {k: v for k, v in LORA_REQUEST.items() if k in ("num_frames", "height", "width")}
    lora_ref = _lora_reference(tiny_model, lora, RANKS_PROMPT, seed=LORA_REQUEST["seed"], **request)
    for name in ("lora", "lora-replicas"):
        assert max_abs_diff(np.load(folder / "out" / f"{name}.npy"), lora_ref) <= 2, name
