"""The phases of benchmarks/gpu_check.py: checkpoints, parity against diffusers, inline vs mp, the timed
comparison, torch.compile. Each takes the run's `Sizes` and a `Guard` (its time left) and returns a JSON-able dict
with a "status": "ok", "failed" (a parity check failed), or "skipped" (with a "reason")."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROMPT = "a red fox running through snow"
NEGATIVE = "blurry, low quality"


@dataclass
class Sizes:
    """What one mode runs. GPU: the real shapes; smoke: tiny ones on CPU in float32."""

    mode: str
    device: str | None  # None: distvideo's choice (cuda:0 on a GPU machine)
    small: dict[str, Any]  # build_test_checkpoint overrides
    large: dict[str, Any]  # build_wan21_1_3b_checkpoint overrides ({}: the real shape)
    parity: dict[str, int]  # num_frames, height, width, steps of the parity requests
    mp_ranks: list[int]  # mp world sizes compared with inline (1: byte-identical; more: within 2, a layout change)
    steps: int
    shapes: list[dict[str, int]]  # num_frames, height, width, warmup, runs of each timed shape
    budgets: dict[str, float]  # seconds per phase
    matmul_size: int | None = None
    dtype: str | None = None  # None: the device's default dtypes (bfloat16 on CUDA, float32 on CPU)


# Against diffusers' WanPipeline (same checkpoint, request, device, dtypes, seed), two checks:
# - float32: frames within 2 on uint8, the project's rule (distvideo's exact plans only reorder float32 sums);
# - bfloat16: no fixed bound carries over from float32: one bfloat16 rounding is 2^-9 relative (half a uint8 level at
#   full scale), a difference met early is carried through every later layer and step, and the GPU's attention and
#   matmul kernels accumulate differently from the CPU's. So the bound is measured in the same run: diffusers in
#   bfloat16 is itself some distance from diffusers in float32 (its own rounding error); distvideo in bfloat16 must be
#   no further from that float32 reference than 1.5 times diffusers' distance (+ 0.05; mean over pixels), and its max
#   within twice diffusers' max + 4. Calibration on CPU (the 256-wide checkpoint, 17 x 128 x 128, 8 UniPC steps,
#   guidance 5): diffusers bf16 vs f32 mean 0.752 / max 6, distvideo bf16 vs diffusers f32 mean 0.745 / max 7 (ratio
#   0.99), float32 max 1. Simulated bugs in distvideo bf16 against f32: guidance 4.5 instead of 5 mean 1.40 / max 17,
#   no CFG mean 9.9 / max 104, 7 steps instead of 8 mean 9.0 / max 85: each over the bounds (1.18 / 16).
BF16_MEAN_FACTOR, BF16_MEAN_SLACK, BF16_MAX_FACTOR, BF16_MAX_SLACK, F32_MAX = 1.5, 0.05, 2.0, 4, 2
LAYOUT_TOLERANCE = 2  # docs: another parallel layout reproduces single-rank frames within 2 on uint8

GPU = Sizes(
    mode="gpu",
    device=None,
    small={},  # the 256-wide benchmark checkpoint
    large={},
    parity={"num_frames": 17, "height": 128, "width": 128, "steps": 8},
    mp_ranks=[1],  # one GPU: mp with one rank (NCCL group of one beside the gloo control group)
    steps=20,
    shapes=[
        {"num_frames": 33, "height": 480, "width": 832, "warmup": 1, "runs": 2},
        {"num_frames": 81, "height": 480, "width": 832, "warmup": 0, "runs": 1},
    ],
    budgets={
        "build": 110,
        "table14b": 300,
        "parity_diffusers": 60,
        "parity_executors": 50,
        "bench": 240,
        "layout_estimate": 10,
        "caching": 100,
        "quantize": 120,
        "offload": 90,
        "few_step": 60,
        "compile": 150,
        "resume": 30,
    },
)
TINY_1_3B = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32, vae_base_dim=8)
SMOKE = Sizes(
    mode="smoke",
    device="cpu",
    small={"num_layers": 2},
    large={**TINY_1_3B, "dtype": torch.float32, "text_num_heads": 2, "text_d_kv": 8, "text_d_ff": 64},
    parity={"num_frames": 5, "height": 32, "width": 32, "steps": 3},
    mp_ranks=[1, 2],  # two ranks on gloo: cfg=2
    steps=2,
    shapes=[
        {"num_frames": 5, "height": 32, "width": 48, "warmup": 0, "runs": 1},
        {"num_frames": 9, "height": 32, "width": 48, "warmup": 0, "runs": 1},
    ],
    # generous: on a loaded 2-core machine a phase takes several times its quiet 5-25 s; the budgets guard hangs
    budgets={
        "build": 60,
        "table14b": 120,
        "parity_diffusers": 120,
        "parity_executors": 120,
        "bench": 120,
        "layout_estimate": 10,
        "caching": 60,
        "quantize": 60,
        "offload": 5,
        "few_step": 60,
        "compile": 5,
        "resume": 5,
    },
    matmul_size=128,
)


TRANSFORMER_KEYS = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "in_channels", "text_dim")


class Guard:
    """Seconds left to a phase: its own budget, capped by the whole run's deadline."""

    def __init__(self, budget: float, run_deadline: float):
        self.deadline = min(time.monotonic() + budget, run_deadline)

    def left(self) -> float:
        return self.deadline - time.monotonic()


# -- checkpoints ----------------------------------------------------------------------------------


def build(sizes: Sizes, folder: Path, guard: Guard) -> dict[str, Any]:
    """The small (parity) and the large (timing) checkpoint, reused from `folder` when built with the same config."""
    from distvideo.testing.checkpoints import (
        BENCHMARK_CHECKPOINT_CONFIG,
        TEST_CHECKPOINT_CONFIG,
        WAN21_T2V_1_3B_CONFIG,
        build_tiny_wan,
    )

    base_small = BENCHMARK_CHECKPOINT_CONFIG if sizes.mode == "gpu" else TEST_CHECKPOINT_CONFIG
    large = {**WAN21_T2V_1_3B_CONFIG, **sizes.large}
    out: dict[str, Any] = {"status": "ok"}
    for name, config in (("small", {**base_small, **sizes.small}), ("large", large)):
        path = folder / name
        stamp = json.dumps({k: str(v) for k, v in sorted(config.items())})
        began = time.monotonic()
        reused = (path / "gpu_check_config.json").is_file() and (path / "gpu_check_config.json").read_text() == stamp
        if not reused:
            build_tiny_wan(path, **config)
            (path / "gpu_check_config.json").write_text(stamp)
        transformer = json.loads((path / "transformer" / "config.json").read_text())
        vae = json.loads((path / "vae" / "config.json").read_text())
        text = json.loads((path / "text_encoder" / "config.json").read_text())
        out[name] = {
            "path": str(path),
            "reused": reused,
            "build_s": round(time.monotonic() - began, 2),
            "transformer": {k: transformer[k] for k in TRANSFORMER_KEYS},
            "vae": {"base_dim": vae["base_dim"], "z_dim": vae["z_dim"]},
            "text_encoder": {k: text[k] for k in ("d_model", "num_layers", "num_heads", "d_ff")},
            "gigabytes": round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e9, 3),
        }
    return out


# -- parity ---------------------------------------------------------------------------------------


def bench_plan(
    model: str,
    sizes: Sizes,
    shape: dict[str, int],
    steps: int,
    runs: int = 1,
    warmup: int = 0,
    dtype: str | None = None,
    compare: bool = True,
    compile: bool = False,
    extra: tuple[str, ...] = (),
) -> Any:
    """A `distvideo bench` plan (the FLOP count, the resolved engine and request) for one shape of `model`;
    `dtype` (default `sizes.dtype`, else the device's default dtypes) of the transformer and text encoder; `compare`:
    against diffusers; `compile`: with --compile; `extra`: more bench flags (``--image PATH``)."""
    from distvideo.bench import add_bench_parser, plan_from_args

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    argv = ["bench", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--no-progress"]
    argv += ["--num-frames", str(shape["num_frames"]), "--height", str(shape["height"]), "--width", str(shape["width"])]
    argv += ["--steps", str(steps), "--guidance-scale", "5", "--runs", str(runs), "--warmup", str(warmup)]
    argv += ["--compare", "diffusers"] if compare else []
    argv += ["--compile"] if compile else []
    argv += ["--executor", "inline", "--log-level", "WARNING", *extra]
    argv += ["--device", sizes.device] if sizes.device else []
    dtype = dtype or sizes.dtype
    argv += ["--dtype", dtype] if dtype else []
    argv += ["--matmul-size", str(sizes.matmul_size)] if sizes.matmul_size else []
    return plan_from_args(parser.parse_args(argv))


def frame_diff(ours: Any, theirs: Any) -> dict[str, Any]:
    if ours.shape != theirs.shape:
        return {"shape": [list(ours.shape), list(theirs.shape)], "max_abs_diff": None, "mean_abs_diff": None}
    diff = np.abs(ours.astype(np.int16) - theirs.astype(np.int16))
    return {"shape": list(ours.shape), "max_abs_diff": int(diff.max()), "mean_abs_diff": float(diff.mean())}


def perturb(frames: Any) -> Any:
    """The test-only break: one pixel of distvideo's frames moved by 128 levels."""
    broken = frames.copy()
    broken[0, 0, 0, 0] ^= 0x80
    return broken


def _diffusers_frames(plan: Any, env: dict[str, Any], dtypes: dict[str, dict[str, str]]) -> dict[str, Any]:
    """diffusers' WanPipeline frames for `plan.request` with each of `dtypes` (name -> component dtypes), one
    process each, started together (their imports overlap)."""
    from distvideo.bench.baseline import DiffusersBaseline, DiffusersSpec

    processes = {name: DiffusersBaseline() for name in dtypes}
    try:
        frames = {}
        for name, process in processes.items():
            process.load(DiffusersSpec(str(plan.engine.config.model), env["device"], dtypes[name], env["threads"]))
            frames[name] = process.run(plan.request, return_frames=True)["frames"]
        return frames
    finally:
        for process in processes.values():
            process.close()


def _distvideo_frames(small: str, sizes: Sizes, dtype: str) -> tuple[Any, dict[str, Any]]:
    from distvideo.bench.measure import distvideo_run, rank_environment
    from distvideo.generator import VideoGenerator

    plan = bench_plan(small, sizes, sizes.parity, sizes.parity["steps"], dtype=dtype)
    with VideoGenerator.from_engine(plan.engine) as gen:
        env = gen.collective_rpc(rank_environment)[0]
        _, frames = distvideo_run(gen, plan.request)
    return plan, {"frames": frames, "env": env}


def parity_diffusers(sizes: Sizes, small: str, guard: Guard, broken: bool) -> dict[str, Any]:
    """distvideo (inline) against diffusers' WanPipeline in its own process, in float32 and in bfloat16, same
    checkpoint, request and device; the bounds are explained above BF16_MEAN_FACTOR."""
    plan, f32 = _distvideo_frames(small, sizes, "float32")
    _, bf16 = _distvideo_frames(small, sizes, "bfloat16")
    ref = _diffusers_frames(plan, f32["env"], {"float32": f32["env"]["dtypes"], "bfloat16": bf16["env"]["dtypes"]})
    ours_f32 = perturb(f32["frames"]) if broken else f32["frames"]
    ours_bf16 = perturb(bf16["frames"]) if broken else bf16["frames"]
    f32_diff = frame_diff(ours_f32, ref["float32"])
    floor = frame_diff(ref["bfloat16"], ref["float32"])  # diffusers' own bfloat16 error
    ours = frame_diff(ours_bf16, ref["float32"])  # distvideo's bfloat16 error
    bounds = {
        "float32_max_abs_diff": F32_MAX,
        "bfloat16_mean_vs_float32": BF16_MEAN_FACTOR * (floor["mean_abs_diff"] or 0.0) + BF16_MEAN_SLACK,
        "bfloat16_max_vs_float32": BF16_MAX_FACTOR * (floor["max_abs_diff"] or 0) + BF16_MAX_SLACK,
    }
    checks = {
        "float32": f32_diff["max_abs_diff"] is not None and f32_diff["max_abs_diff"] <= F32_MAX,
        "bfloat16_mean": ours["mean_abs_diff"] is not None
        and ours["mean_abs_diff"] <= bounds["bfloat16_mean_vs_float32"],
        "bfloat16_max": ours["max_abs_diff"] is not None and ours["max_abs_diff"] <= bounds["bfloat16_max_vs_float32"],
    }
    return {
        "status": "ok" if all(checks.values()) else "failed",
        "checks": checks,
        "bounds": bounds,
        "device": f32["env"]["device"],
        "request": {**sizes.parity, "guidance_scale": 5.0, "seed": 0},
        "float32_vs_diffusers_float32": f32_diff,
        "bfloat16_vs_diffusers_bfloat16": frame_diff(ours_bf16, ref["bfloat16"]),
        "bfloat16_vs_diffusers_float32": ours,
        "diffusers_bfloat16_vs_diffusers_float32": floor,
    }


def _frames(small: str, sizes: Sizes, executor: str, ranks: int) -> Any:
    from distvideo.config import EngineConfig
    from distvideo.generator import VideoGenerator

    p = sizes.parity
    config = EngineConfig(
        model=small, executor=executor, num_gpus=ranks, device=sizes.device, dtype="float32", progress=False
    )
    with VideoGenerator.from_config(config) as gen:
        result = gen.generate(
            PROMPT,
            negative_prompt=NEGATIVE,
            num_frames=p["num_frames"],
            height=p["height"],
            width=p["width"],
            num_inference_steps=p["steps"],
            guidance_scale=5.0,
            seed=0,
            save_video=False,
        )
    return result.frames


def parity_executors(sizes: Sizes, small: str, guard: Guard, broken: bool) -> dict[str, Any]:
    """float32 frames of the inline executor against the mp executor: byte-identical with one mp rank (the same
    layout), within 2 with more (another layout: cfg=2 over two ranks)."""
    inline = _frames(small, sizes, "inline", 1)
    out: dict[str, Any] = {"status": "ok", "dtype": "float32", "request": sizes.parity, "mp": {}}
    for ranks in sizes.mp_ranks:
        if guard.left() < 5:
            out["mp"][str(ranks)] = {"status": "skipped", "reason": f"{guard.left():.0f} s left in the phase"}
            continue
        mp = _frames(small, sizes, "mp", ranks)
        mp = perturb(mp) if broken else mp
        diff = frame_diff(mp, inline)
        if ranks == 1:
            ok = mp.shape == inline.shape and mp.tobytes() == inline.tobytes()
            check = "byte-identical"
        else:
            ok = diff["max_abs_diff"] is not None and diff["max_abs_diff"] <= LAYOUT_TOLERANCE
            check = f"max abs diff <= {LAYOUT_TOLERANCE}"
        out["mp"][str(ranks)] = {"status": "ok" if ok else "failed", "check": check, **diff}
        if not ok:
            out["status"] = "failed"
    return out


# -- timing ---------------------------------------------------------------------------------------


def _stopper(guard: Guard, estimate: Callable[[], float | None]) -> Callable[[float | None], bool]:
    """Stop before a run that would not fit: it takes as long as the previous one, or `estimate()` for the first."""

    def stop(last: float | None) -> bool:
        need = last if last is not None else estimate()
        return need is not None and need > guard.left()

    return stop


def bench(sizes: Sizes, large: str, guard: Guard, progress: Callable[[str], None]) -> dict[str, Any]:
    """Each shape of `sizes.shapes` timed by `distvideo bench`'s loop, distvideo and diffusers interleaved run by
    run, one distvideo engine and one diffusers process for all shapes (the later shapes run warm). A shape that
    would not fit in the time left is skipped; its first run's time is estimated from the previous shape's
    measured pair scaled by the FLOP count."""
    from distvideo.bench.measure import rank_environment
    from distvideo.bench.report import build_report, format_report
    from distvideo.bench.run import load_baseline, measure_interleaved
    from distvideo.generator import VideoGenerator

    plans = [bench_plan(large, sizes, s, sizes.steps, s["runs"], s["warmup"]) for s in sizes.shapes]
    out: dict[str, Any] = {"status": "ok", "shapes": {}}
    with VideoGenerator.from_engine(plans[0].engine) as gen:
        envs = gen.collective_rpc(rank_environment)
        notes: list[str] = []
        baseline = load_baseline(gen, plans[0], plans[0].request, envs, notes)
        progress(f"loaded distvideo and diffusers ({guard.left():.0f} s left)")
        previous: tuple[Any, float] | None = None  # (plan, seconds of one pair)
        try:
            for shape, plan in zip(sizes.shapes, plans, strict=True):
                key = f"{shape['num_frames']}x{shape['height']}x{shape['width']}"

                def estimate(plan: Any = plan, previous: Any = previous) -> float | None:
                    return previous[1] * plan.model_flops / previous[0].model_flops if previous else None

                began, shape_notes = time.monotonic(), list(notes)
                runs, diff = measure_interleaved(
                    gen, plan, plan.request, baseline, shape_notes, stop=_stopper(guard, estimate)
                )
                done = plan.warmup + len(runs)
                if done:
                    previous = (plan, (time.monotonic() - began) / done)
                if not runs:
                    out["shapes"][key] = {"status": "skipped", "reason": "out of time", "notes": shape_notes}
                    progress(f"{key}: skipped, out of time ({guard.left():.0f} s left)")
                    continue
                report = build_report(gen, plan, plan.request, runs, envs, diff, shape_notes)
                out["shapes"][key] = {"status": "ok", "report": report, "table": format_report(report)}
                progress(f"{key}: end to end ratio {report['ratio_e2e']:.3f} ({guard.left():.0f} s left)")
        finally:
            if baseline is not None:
                baseline.close()
    return out


def compile_phase(sizes: Sizes, large: str, guard: Guard, progress: Callable[[str], None]) -> dict[str, Any]:
    """`distvideo bench --compile` (regional torch.compile of the transformer blocks) on the first timed shape of the
    large checkpoint, distvideo only (the bench phase has diffusers' figures for the same shape): the first run, which
    compiles (its `compile_s` is torch's compile time in it), then the measured runs, warm; then, when time is left,
    one uncompiled run of the same request for the frames' difference. Smoke mode skips it: compiling even the tiny
    model takes 20-35 s on two CPU cores, more than the suite's smoke run can spend (tests/test_compile.py covers
    compiled frames and the compile time on CPU)."""
    from distvideo.bench.measure import distvideo_run, rank_environment
    from distvideo.bench.report import build_report, format_report
    from distvideo.bench.run import measure_interleaved
    from distvideo.config import EngineConfig
    from distvideo.generator import VideoGenerator

    if "compile" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        return {"status": "skipped", "reason": "the engine has no torch.compile option (EngineConfig.compile)"}
    if sizes.mode == "smoke":
        return {
            "status": "skipped",
            "reason": "smoke mode: torch.compile takes 20-35 s on 2 CPU cores (tests/test_compile.py covers it)",
        }
    shape = sizes.shapes[0]
    key = f"{shape['num_frames']}x{shape['height']}x{shape['width']}"
    plan = bench_plan(large, sizes, shape, sizes.steps, runs=shape["runs"], compare=False, compile=True)
    out: dict[str, Any] = {"status": "ok", "shape": key, "steps": sizes.steps}
    with VideoGenerator.from_engine(plan.engine) as gen:
        envs = gen.collective_rpc(rank_environment)
        began = time.monotonic()
        first, frames = distvideo_run(gen, plan.request)
        out["first_run"] = first
        progress(f"compile: first run {first['e2e_s']:.1f} s, compile {first.get('compile_s', 0):.1f} s")
        notes: list[str] = []
        first_s = time.monotonic() - began
        runs, _ = measure_interleaved(gen, plan, plan.request, None, notes, stop=_stopper(guard, lambda: first_s))
        if runs:
            report = build_report(gen, plan, plan.request, runs, envs, None, notes)
            out.update(report=report, table=format_report(report))
    if frames is not None and guard.left() > 2 * (first_s if not runs else runs[-1]["distvideo"]["e2e_s"]) + 30:
        eager = bench_plan(large, sizes, shape, sizes.steps, compare=False)
        with VideoGenerator.from_engine(eager.engine) as gen:
            _, reference = distvideo_run(gen, eager.request)
        out["frames_vs_uncompiled"] = frame_diff(frames, reference)
    else:
        out["frames_vs_uncompiled"] = {"status": "skipped", "reason": f"{guard.left():.0f} s left in the phase"}
    progress(f"compile: done ({guard.left():.0f} s left)")
    return out
