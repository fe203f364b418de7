"""The bench's report: medians and ratios of the runs, the environment, the JSON file and the table."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distvideo.bench.measure import default_matmul_size, device_name, median_record
from distvideo.bench.plan import MATMUL_SECONDS, RATIO_FIGURES, BenchPlan
from distvideo.paths import replace_file
from distvideo.request import ResolvedRequest

if TYPE_CHECKING:
    from distvideo.protocols import GeneratorHandle


def build_report(
    gen: GeneratorHandle,
    plan: BenchPlan,
    request: ResolvedRequest,
    runs: list[dict[str, Any]],
    rank_envs: list[dict[str, Any]],
    frames_diff: int | None,
    notes: list[str],
) -> dict[str, Any]:
    ours = median_record([r["distvideo"] for r in runs])
    compared = [r for r in runs if "diffusers" in r]
    theirs = median_record([r["diffusers"] for r in compared]) if compared else None
    ratios = ratios_range = None
    if compared:
        ratios = {name: statistics.median(r["ratios"][name] for r in compared) for name in RATIO_FIGURES}
        ratios_range = {
            name: [min(r["ratios"][name] for r in compared), max(r["ratios"][name] for r in compared)]
            for name in RATIO_FIGURES
        }
    matmul_peak = statistics.median(sum(r["matmul_flops_per_rank"]) for r in runs)
    return {
        "distvideo": ours,
        "diffusers": theirs,
        "ratio_e2e": ratios["e2e_s"] if ratios else None,
        "ratios": ratios,
        "ratios_range": ratios_range,
        "config": {
            "model": str(plan.engine.config.model),
            "prompt": request.prompt,
            "negative_prompt": request.negative_prompt,
            "num_frames": request.num_frames,
            "height": request.height,
            "width": request.width,
            "steps": request.num_inference_steps,
            "guidance_scale": request.guidance_scale,
            "seed": request.seed,
            "fps": request.fps,
            "runs": plan.runs,
            "warmup": plan.warmup,
            "compare": plan.compare,
            "latent_shape": list(plan.latent_shape),
            "text_len": request.max_sequence_length,
            "transformer_forwards": plan.transformer_forwards,
            "transformer_flops_per_forward": plan.flops_per_forward,
            "transformer_flops_breakdown": plan.flops_breakdown,
        },
        "matmul_peak_flops": matmul_peak,
        "check": {"frames_max_abs_diff": frames_diff},
        "env": environment(gen, plan, rank_envs, runs),
        "notes": notes,
        "runs": runs,
    }


def environment(
    gen: GeneratorHandle, plan: BenchPlan, rank_envs: list[dict[str, Any]], runs: list[dict[str, Any]]
) -> dict:
    import diffusers
    import torch
    import transformers

    first = rank_envs[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": device_name(torch.device("cpu")),
        "cores": cores,
        "device": first["device"],
        "device_name": first["device_name"],
        "dtypes": first["dtypes"],
        "threads": first["threads"],
        "threads_per_rank": [e["threads"] for e in rank_envs],
        "world_size": gen.world_size,
        "executor": gen.config.executor,
        "sp_size": gen.engine.layout.sp_size,
        "ulysses_size": gen.engine.layout.ulysses_size,
        "ring_size": gen.engine.layout.ring_size,
        "cfg_parallel": gen.engine.layout.cfg_enabled,
        "memory_metric": runs[0]["distvideo"]["memory_metric"] if runs else None,
        "matmul": {
            "size": plan.matmul_size or default_matmul_size(torch.device(first["device"])),
            "dtype": first["dtypes"]["transformer"],
            "seconds": MATMUL_SECONDS,
            "statistic": "best of 5 windows, measured before every run on every rank at once",
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    """Atomically (paths.replace_file)."""
    replace_file(path, json.dumps(report, indent=2) + "\n")


# -- the table -----------------------------------------------------------------------------------


def _seconds(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.2f}"


def _flops(value: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} FLOP"


def format_report(report: Mapping[str, Any]) -> str:
    ours, theirs, ratios = report["distvideo"], report["diffusers"], report["ratios"] or {}
    cfg, env = report["config"], report["env"]
    rows: list[tuple[str, Callable[[Mapping[str, Any]], str], str | None]] = [
        ("end to end (s)", lambda r: _seconds(r["e2e_s"]), "e2e_s"),
        ("  text encoding (s)", lambda r: _seconds(r["stages"]["text_encoding"]), "text_encoding"),
        ("  denoising (s)", lambda r: _seconds(r["stages"]["denoising"]), "denoising"),
        ("    per step (s)", lambda r: _seconds(r["stages"]["denoising_per_step"]), "denoising_per_step"),
        ("  decoding (s)", lambda r: _seconds(r["stages"]["decoding"]), "decoding"),
        ("peak memory (MiB)", lambda r: f"{r['peak_memory_mb']:.0f}", "peak_memory_mb"),
        ("transformer (FLOP/s)", lambda r: _flops(r["achieved_flops"]) + "/s", None),
        ("MFU", lambda r: f"{100 * r['mfu']:.1f}%", None),
    ]
    width = 22
    lines = [
        f"distvideo bench  {cfg['model']}",
        f"  {cfg['num_frames']} frames x {cfg['height']}x{cfg['width']}, {cfg['steps']} steps, guidance "
        f"{cfg['guidance_scale']}, seed {cfg['seed']}; latents {'x'.join(map(str, cfg['latent_shape'][1:]))}; "
        f"{cfg['transformer_forwards']} transformer forwards of {_flops(cfg['transformer_flops_per_forward'])}",
        f"  medians of {cfg['runs']} runs (+{cfg['warmup']} warm-up)"
        + (
            "; interleaved, ratio = median over runs of distvideo / diffusers (< 1: distvideo better)" if theirs else ""
        ),
        "",
        f"{'':{width}}{'distvideo':>14}{'diffusers' if theirs else '':>14}{'ratio' if theirs else '':>9}"
        f"{'(min-max)' if theirs else '':>14}",
    ]
    for label, show, key in rows:
        line = f"{label:{width}}{show(ours):>14}"
        if theirs:
            line += f"{show(theirs):>14}"
            if key:
                low, high = report["ratios_range"][key]
                line += f"{ratios[key]:>9.3f}{f'{low:.2f}-{high:.2f}':>14}"
        lines.append(line)
    check = report["check"]["frames_max_abs_diff"]
    lines += [
        "",
        f"matmul peak {_flops(report['matmul_peak_flops'])}/s ({env['matmul']['dtype']} "
        f"{env['matmul']['size']}^3, {env['threads']} thread(s) per rank); MFU = transformer FLOP/s / matmul peak",
        f"memory: {env['memory_metric']}",
    ]
    for label, key in (
        ("peak", "peak_memory_mb_per_rank"),
        ("weights held", "weights_mb_per_rank"),
        ("peak above loaded", "peak_above_loaded_mb_per_rank"),
    ):
        per_rank = ours.get(key)
        if per_rank:
            lines.append(f"  {label} per rank (MiB): {', '.join(f'{m:.0f}' for m in per_rank)}")
    quantized = {name: w for name, w in (ours.get("weights") or {}).items() if w["mode"] != "none"}
    if quantized:
        lines.append(
            "quantized: "
            + ", ".join(
                f"{name} {w['mode']} ({w['quantized_modules']} layers, {w['bytes'] / 2**20:.0f} MiB)"
                for name, w in quantized.items()
            )
        )
    cache = ours.get("cache")
    if cache is not None:
        lines.append(
            f"step cache: {cache['method']}, {cache['computed_steps']} steps computed, skipped {cache['skipped_steps']}"
        )
    if check is not None:
        lines.append(f"frames: max |distvideo - diffusers| = {check} (uint8)")
    lines.append(
        f"env: torch {env['torch']}, diffusers {env['diffusers']}, {env['device']} ({env['device_name']}), "
        f"{env['cores']} cores, world size {env['world_size']} ({env['executor']}), {env['date']}"
    )
    lines += [f"note: {note}" for note in report["notes"]]
    if theirs is None and cfg["compare"] is None:
        lines.append("(add --compare diffusers for the reference column)")
    return "\n".join(line.rstrip() for line in lines)
