"""Phases of benchmarks/gpu_check.py added for what landed after it was written (issue 32): step caching on the
1.3B-shaped checkpoint, the automatic layout's estimate for one device against the bench phase's measurement, and
(issue 51) the low-precision modes and attention kernels against the unquantized engine.

Ring attention and sharded weights have no phase: on one device both are no-ops (a ring of one rank, a replica of
one rank holds every weight; `ParallelContext.shard_plans` applies nothing), and two NCCL ranks cannot share one GPU.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: the step-cache settings timed, in order (the first uncached run is the reference for time and frames)
CACHE_RUNS: tuple[dict[str, Any], ...] = (
    {"cache": "first-block"},  # its default threshold, 0.05
    {"cache": "first-block", "cache_threshold": 0.1},
    {"cache": "mag"},  # its default threshold, 0.06, on ratios calibrated in the same phase
)


def psnr(ours: Any, reference: Any) -> float | None:
    """PSNR in dB of uint8 frames against a reference (inf when equal; None when the shapes differ)."""
    if ours.shape != reference.shape:
        return None
    mse = float(np.mean((ours.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _timed(run: dict[str, Any]) -> dict[str, Any]:
    stages = run["stages"]
    return {
        "e2e_s": round(run["e2e_s"], 3),
        "denoising_s": round(stages["denoising"], 3),
        "denoising_per_step_s": round(stages["denoising_per_step"], 4),
        "decoding_s": round(stages["decoding"], 3),
        "peak_memory_mb": run["peak_memory_mb"],
        "cache": run.get("cache"),
    }


def caching_phase(sizes: Any, large: str, guard: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    """On the large checkpoint at the first timed shape and the run's step count (at least MIN_CACHE_STEPS), one
    inline engine: a short warm-up,
    MagCache's calibration run (every step computed; its ratios written beside the checkpoint), the uncached
    reference, then each of CACHE_RUNS: denoising time and speedup against the reference, the skipped steps, and the
    frames' PSNR and max difference against the reference. Random weights: the steps skipped at a threshold are not
    a trained model's; the time a skipped step saves is. A run that would not fit in the time left is skipped."""
    from gpu_check_phases import bench_plan, frame_diff

    from distvideo.bench.measure import distvideo_run
    from distvideo.generator import VideoGenerator
    from distvideo.models.cache_ratios import MIN_CACHE_STEPS, ratios_key, scheduler_name, write_ratios
    from distvideo.request import CACHE_CALIBRATE

    shape = sizes.shapes[0]
    key = f"{shape['num_frames']}x{shape['height']}x{shape['width']}"
    steps = max(sizes.steps, MIN_CACHE_STEPS)  # a step cache is refused below it (the smoke run's 2 steps)
    plan = bench_plan(large, sizes, shape, steps, compare=False)
    base = dataclasses.replace(plan.request, save_video=False, return_frames=True)
    out: dict[str, Any] = {"status": "ok", "shape": key, "steps": steps, "runs": {}}
    with VideoGenerator.from_engine(plan.engine) as gen:
        distvideo_run(gen, dataclasses.replace(base, num_inference_steps=2))  # kernels, allocator: untimed
        began = time.monotonic()
        calibration, _ = distvideo_run(gen, dataclasses.replace(base, cache=CACHE_CALIBRATE))
        one_run = time.monotonic() - began
        ratios = (calibration.get("cache") or {}).get("ratios")
        if ratios:
            model = gen.model_info
            name = ratios_key(scheduler_name(model.index), steps)
            write_ratios(model.path, scheduler_name(model.index), steps, ratios)
            for info in {id(m): m for m in (model, plan.engine.model)}.values():
                info.cache_ratios[name] = [float(r) for r in ratios]
        out["calibration"] = {"denoising_s": round(calibration["stages"]["denoising"], 3), "ratios": ratios}
        progress(f"caching: calibrated in {one_run:.1f} s ({guard.left():.0f} s left)")
        reference, ref_frames = distvideo_run(gen, base)
        out["runs"]["none"] = _timed(reference)
        assert ref_frames is not None
        for settings in CACHE_RUNS:
            label = settings["cache"] + (f" {settings['cache_threshold']}" if "cache_threshold" in settings else "")
            if guard.left() < one_run + 5:
                out["runs"][label] = {"status": "skipped", "reason": f"{guard.left():.0f} s left in the phase"}
                continue
            try:
                record, frames = distvideo_run(gen, dataclasses.replace(base, **settings))
            except Exception as exc:  # one method's failure is that run's result, not the phase's
                out["runs"][label] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
                out["status"] = "error"
                continue
            assert frames is not None
            timed = _timed(record)
            timed["speedup_denoising"] = round(reference["stages"]["denoising"] / record["stages"]["denoising"], 3)
            timed["psnr_db"] = psnr(frames, ref_frames)
            timed["vs_uncached"] = frame_diff(frames, ref_frames)
            out["runs"][label] = {"status": "ok", **timed}
            progress(
                f"caching: {label}: {timed['speedup_denoising']:.2f}x, skipped "
                f"{len((record.get('cache') or {}).get('skipped_steps', []))} of {steps}, PSNR "
                f"{timed['psnr_db']:.1f} dB ({guard.left():.0f} s left)"
            )
    return out


def _figure(value: float) -> float:
    """Four significant digits."""
    return float(f"{value:.4g}")


def layout_estimate_phase(result: dict[str, Any], sizes: Any, large: str) -> dict[str, Any]:
    """The cost model's time per denoising step for one device (parallel/planner.py's `plan_for`, world 1, the
    device's kind and dtype as the bench ran) against the bench phase's measured distvideo median, per shape."""
    from distvideo.models.registry import probe_model
    from distvideo.parallel.planner import plan_for
    from distvideo.request import GenerationRequest

    shapes = result["phases"].get("bench", {}).get("shapes", {})
    measured = {k: s["report"] for k, s in shapes.items() if s.get("status") == "ok"}
    if not measured:
        return {"status": "skipped", "reason": "the bench phase measured no shape"}
    model = probe_model(large)
    out: dict[str, Any] = {"status": "ok", "shapes": {}}
    for key, report in measured.items():
        frames, height, width = (int(n) for n in key.split("x"))
        env = report["env"]
        request = GenerationRequest(prompt="plan", num_frames=frames, height=height, width=width, guidance_scale=5.0)
        dtype = (env.get("dtypes") or {}).get("transformer")
        plan = plan_for(
            model, request, 1, device=env["device"], dtype=dtype if dtype in ("float32", "bfloat16") else None
        )
        step = report["distvideo"]["stages"]["denoising_per_step"]
        out["shapes"][key] = {
            "measured_step_s": _figure(step),
            "estimated_step_s": _figure(plan.chosen.time),
            "estimate_over_measured": _figure(plan.chosen.time / step),
            "estimated_terms_s": {k: _figure(v) for k, v in plan.chosen.parts.items()},
            "estimated_memory_gib": round(plan.chosen.memory / 2**30, 2),
            "measured_peak_memory_gib": round(report["distvideo"]["peak_memory_mb"] / 1024, 2),
            "mfu": report["distvideo"].get("mfu"),
        }
    return out


def markdown_lines(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    caching = result["phases"].get("caching", {})
    if caching.get("runs"):
        lines += ["", f"## step caching, {caching['shape']}, {caching['steps']} steps (random weights)", ""]
        lines += ["| cache | denoising (s) | speedup | skipped steps | PSNR vs uncached (dB) | max diff |"]
        lines += ["| --- | ---: | ---: | --- | ---: | ---: |"]
        for label, r in caching["runs"].items():
            if r.get("status", "ok") != "ok":
                lines.append(f"| {label} | {r['status']}: {r.get('reason') or r.get('error')} | | | | |")
                continue
            skipped = (r.get("cache") or {}).get("skipped_steps", [])
            psnr_db = r.get("psnr_db")
            lines.append(
                f"| {label} | {r['denoising_s']:.3f} | {r.get('speedup_denoising', 1.0):.2f} | {len(skipped)}: "
                f"{skipped} | {'' if psnr_db is None else f'{psnr_db:.1f}'} | "
                f"{(r.get('vs_uncached') or {}).get('max_abs_diff', '')} |"
            )
    lines += _quantize_lines(result["phases"].get("quantize", {}))
    estimate = result["phases"].get("layout_estimate", {})
    if estimate.get("shapes"):
        lines += ["", "## the automatic layout's estimate for one device", ""]
        lines += ["| shape | measured s/step | estimated s/step | estimate / measured | MFU |"]
        lines += ["| --- | ---: | ---: | ---: | ---: |"]
        for key, s in estimate["shapes"].items():
            mfu = s.get("mfu")
            lines.append(
                f"| {key} | {s['measured_step_s']} | {s['estimated_step_s']} | {s['estimate_over_measured']} | "
                f"{'' if mfu is None else f'{100 * mfu:.1f}%'} |"
            )
    return lines


#: the low-precision settings timed against the unquantized engine (docs/performance.md, "Low precision"); on the
#: GPU every one, each alone and then the fast ones together; in --smoke mode fp8-weight runs (no torchao import, a
#: few seconds of every suite run; tests/test_quantize.py covers the torchao modes) and fp8 shows its refusal
QUANTIZE_RUNS: tuple[dict[str, str], ...] = (
    {"quantize": "int8"},
    {"quantize": "int8-weight"},
    {"quantize": "fp8"},
    {"quantize": "fp8-weight"},
    {"attention": "sage"},
    {"attention": "flash"},
    {"quantize": "fp8", "attention": "sage"},
)
SMOKE_QUANTIZE_RUNS: tuple[dict[str, str], ...] = ({"quantize": "fp8-weight"}, {"quantize": "fp8"})
QUANTIZE_STEPS = 4  # per-step figures: a few steps after a one-step warm-up


def engine_with(engine: Any, settings: dict[str, Any], device: str | None) -> tuple[Any, str | None]:
    """`engine` with `settings` (EngineConfig fields), or distvideo's refusal of them on this device (the text of its
    ConfigError: fp8 without float8 matrix products, sage without its package or CUDA)."""
    import torch

    from distvideo.errors import ConfigError
    from distvideo.models.quantize import DeviceKind, check_support

    config = dataclasses.replace(engine.config, **settings)
    try:
        check_support(config, DeviceKind.of(torch.device(device or "cuda")))
    except ConfigError as exc:
        return engine, str(exc)
    return dataclasses.replace(engine, config=config), None


def warm_then_timed(engine: Any, request: Any, first: Callable[[Any], None] | None = None) -> tuple[dict, Any]:
    """On a fresh engine: `first(gen)` if given, a one-step warm-up (kernels, the allocator, torch.compile: untimed),
    then `request` measured by `distvideo bench`'s run (record, frames)."""
    from distvideo.bench.measure import distvideo_run
    from distvideo.generator import VideoGenerator

    with VideoGenerator.from_engine(engine) as gen:
        if first is not None:
            first(gen)
        distvideo_run(gen, dataclasses.replace(request, num_inference_steps=1))
        return distvideo_run(gen, request)


def quantize_phase(sizes: Any, large: str, guard: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    """On the large checkpoint at the first timed shape, one engine per setting (the unquantized one first): the
    denoising time per step and its speedup, the frames' PSNR and max difference against the unquantized frames,
    and the weight report (quantized layers and bytes per component: the proof that the mode ran). A setting the
    device cannot run is recorded as skipped with distvideo's refusal; one that would not fit the time left too."""
    from gpu_check_phases import bench_plan, frame_diff

    shape = sizes.shapes[0]
    plan = bench_plan(large, sizes, shape, QUANTIZE_STEPS, compare=False)
    base = dataclasses.replace(plan.request, save_video=False, return_frames=True)
    runs = SMOKE_QUANTIZE_RUNS if sizes.mode == "smoke" else QUANTIZE_RUNS
    out: dict[str, Any] = {"status": "ok", "shape": f"{shape['num_frames']}x{shape['height']}x{shape['width']}"}
    out |= {"steps": QUANTIZE_STEPS, "runs": {}}
    reference: tuple[dict[str, Any], Any] | None = None
    one_run = 0.0
    for settings in ({}, *runs):
        label = ", ".join(f"{name} {value}" for name, value in settings.items()) or "none"
        engine, refusal = engine_with(plan.engine, settings, sizes.device)
        if refusal is not None:
            out["runs"][label] = {"status": "skipped", "reason": refusal}
            continue
        if reference is not None and guard.left() < one_run + 5:
            out["runs"][label] = {"status": "skipped", "reason": f"{guard.left():.0f} s left in the phase"}
            continue
        began = time.monotonic()
        try:
            record, frames = warm_then_timed(engine, base)
        except Exception as exc:  # one setting's failure is that run's result, not the phase's
            out["runs"][label] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            out["status"] = "error"
            continue
        one_run = max(one_run, time.monotonic() - began)
        timed = {**_timed(record), "weights": record.get("weights")}
        if reference is None:
            reference = (record, frames)
        else:
            timed["speedup_denoising"] = round(reference[0]["stages"]["denoising"] / record["stages"]["denoising"], 3)
            timed["psnr_db"] = psnr(frames, reference[1])
            timed["vs_unquantized"] = frame_diff(frames, reference[1])
        out["runs"][label] = {"status": "ok", **timed}
        progress(f"quantize: {label}: {timed['denoising_per_step_s']:.3f} s/step ({guard.left():.0f} s left)")
    return out


def _quantize_lines(phase: dict[str, Any]) -> list[str]:
    if not phase.get("runs"):
        return []
    lines = ["", f"## low precision, {phase['shape']}, {phase['steps']} steps (random weights)", ""]
    lines += ["| setting | s/step | speedup | PSNR vs unquantized (dB) | max diff | transformer weights (MiB) |"]
    lines += ["| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, r in phase["runs"].items():
        if r.get("status", "ok") != "ok":
            reason = str(r.get("reason") or r.get("error")).replace("|", "/")
            lines.append(f"| {label} | {r['status']}: {reason} | | | | |")
            continue
        psnr_db, weights = r.get("psnr_db"), (r.get("weights") or {}).get("transformer", {})
        lines.append(
            f"| {label} | {r['denoising_per_step_s']:.4f} | {r.get('speedup_denoising', 1.0):.2f} | "
            f"{'' if psnr_db is None else f'{psnr_db:.1f}'} | {(r.get('vs_unquantized') or {}).get('max_abs_diff', '')} "
            f"| {weights.get('bytes', 0) / 2**20:.1f} |"
        )
    return lines
