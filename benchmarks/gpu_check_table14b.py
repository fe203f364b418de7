"""The table14b and resume phases of benchmarks/gpu_check.py (issue 56).

table14b: the row users compare engines by, LightX2V's public table (Wan2.1-I2V-14B, 480 x 832, 81 frames, seconds
per denoising step on one H100, guidance on: both branches counted in a step). A random-weight checkpoint with the
model's exact shapes is drawn on the device (distvideo.testing.wan14b: 16.4 B transformer parameters, UMT5-XXL, CLIP
ViT-H/14), then, one engine at a time, each setting runs a one-step warm-up and a timed request of TABLE_STEPS
steps at the table's shape, bfloat16, guidance 5: distvideo, diffusers' WanImageToVideoPipeline, then distvideo with
every fast path that has landed together (--compile, --quantize fp8, --attention sage), and each alone. Seconds per
step, end to end for the steps run, peak memory, MFU against the device's measured matmul peak; the fast paths' PSNR
against distvideo's plain frames. One engine at a time, not interleaved run by run as the bench phase does: two
14B pipelines (45.9 GB of weights each with their encoders, in bfloat16) do not fit one H100 together. A setting the device refuses is recorded
as skipped with distvideo's refusal, one that would not fit the time left too. In --smoke mode the same code runs a
tiny checkpoint on the CPU (compile skipped: 20-35 s; fp8 refused there).

resume: the checkpoint cost per step of the resumable-jobs issue (54); skipped while its denoising checkpoints have
not landed (no EngineConfig.checkpoint_every).
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TABLE = {"gpu": {"num_frames": 81, "height": 480, "width": 832}, "smoke": {"num_frames": 5, "height": 32, "width": 48}}
TABLE_STEPS = {"gpu": 3, "smoke": 2}
FAST = {"compile": True, "quantize": "fp8", "attention": "sage"}
SETTINGS: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("distvideo", {}),
    ("diffusers", None),
    ("distvideo, every fast path", FAST),
    ("distvideo --compile", {"compile": True}),
    ("distvideo --quantize fp8", {"quantize": "fp8"}),
    ("distvideo --attention sage", {"attention": "sage"}),
)
FLOAT32_BOUND = 2  # float32 (smoke): distvideo's frames within 2 of diffusers', the project's rule


def table14b_phase(sizes: Any, folder: Path, guard: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    from gpu_check_phases import bench_plan

    from distvideo.testing.families import write_test_image
    from distvideo.testing.wan14b import WAN21_I2V_14B_SMOKE, build_wan21_i2v_14b_checkpoint

    shape = TABLE[sizes.mode]
    began = time.monotonic()
    path = build_wan21_i2v_14b_checkpoint(
        folder / "wan21-i2v-14b",
        device=sizes.device or "cuda",
        **(WAN21_I2V_14B_SMOKE if sizes.mode == "smoke" else {}),
    )
    out: dict[str, Any] = {"status": "ok", "build_s": round(time.monotonic() - began, 1)}
    out["gigabytes"] = round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e9, 2)
    progress(f"table14b: built {out['gigabytes']} GB in {out['build_s']} s ({guard.left():.0f} s left)")
    image = write_test_image(folder / "table14b-image.png", width=shape["width"], height=shape["height"])
    steps = TABLE_STEPS[sizes.mode]
    extra = ("--image", str(image))
    plan = bench_plan(str(path), sizes, {**shape, "runs": 1, "warmup": 1}, steps, compare=False, extra=extra)
    table = _Table(sizes, plan)
    out.update(shape=f"{shape['num_frames']}x{shape['height']}x{shape['width']}", steps=steps, runs={})
    out.update(guidance_scale=table.request.guidance_scale, model_flops=plan.model_flops)
    try:
        _rows(table, out, guard, progress)
    finally:  # 45.9 GB on a GPU: the later phases need the disk (each run draws it again)
        shutil.rmtree(path, ignore_errors=True)
    out.update(device=table.env.get("device_name"), dtypes=table.env.get("dtypes"), matmul_peak_flops=table.peak)
    _compare(out, table.frames)
    return out


def _rows(table: _Table, out: dict[str, Any], guard: Any, progress: Callable[[str], None]) -> None:
    last = 0.0
    for label, settings in SETTINGS:
        if table.frames and guard.left() < last + 5:
            out["runs"][label] = {"status": "skipped", "reason": f"{guard.left():.0f} s left in the phase"}
            continue
        started = time.monotonic()
        try:
            record = table.run(label, settings)
        except Exception as exc:  # one setting's failure is that row's result and the phase's; the others still run
            record = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            out["status"] = "error"
        _free()
        if record["status"] == "ok":
            last = max(last, time.monotonic() - started)
            record["mfu"] = round(table.plan.model_flops / record["denoising_s"] / table.peak, 4)
            progress(f"table14b: {label}: {record['denoising_per_step_s']:.3f} s/step ({guard.left():.0f} s left)")
        out["runs"][label] = record


class _Table:
    """The rows' shared state: the plan and request, each row's frames, and what the first distvideo engine measured
    of its rank (device, dtypes, threads: diffusers runs with them; the matmul peak the MFU is taken against)."""

    def __init__(self, sizes: Any, plan: Any):
        self.sizes, self.plan = sizes, plan
        self.request = dataclasses.replace(plan.request, save_video=False, return_frames=True)
        self.frames: dict[str, Any] = {}
        self.env: dict[str, Any] = {}
        self.peak = 0.0

    def run(self, label: str, settings: dict[str, Any] | None) -> dict[str, Any]:
        """One row: a one-step warm-up then the timed request, on a fresh engine (or diffusers' process)."""
        from gpu_check_more import _timed, engine_with, warm_then_timed

        from distvideo.bench.measure import rank_environment, rank_matmul_flops

        if settings is None:
            return self._diffusers(label, dataclasses.replace(self.request, num_inference_steps=1))
        if settings.get("compile") and self.sizes.mode == "smoke":
            return {"status": "skipped", "reason": "smoke mode: torch.compile takes 20-35 s on 2 CPU cores"}
        engine, refusal = engine_with(self.plan.engine, settings, self.sizes.device)
        if refusal is not None:
            return {"status": "skipped", "reason": refusal}

        def measure_rank(gen: Any) -> None:  # once, on the first engine: what diffusers runs with, the MFU's peak
            if not self.env:
                self.env = gen.collective_rpc(rank_environment)[0]
                self.peak = gen.collective_rpc(rank_matmul_flops, args=(self.plan.matmul_size,))[0]

        record, self.frames[label] = warm_then_timed(engine, self.request, first=measure_rank)
        return {"status": "ok", **_timed(record), "compile_s": record.get("compile_s")}

    def _diffusers(self, label: str, warm: Any) -> dict[str, Any]:
        from gpu_check_more import _timed

        from distvideo.bench.baseline import DiffusersBaseline, DiffusersSpec

        if not self.env:
            return {"status": "skipped", "reason": "no distvideo row ran: its rank's device and dtypes are unknown"}
        env = self.env
        baseline = DiffusersBaseline()
        try:
            model = str(self.plan.engine.config.model)
            baseline.load(DiffusersSpec(model, env["device"], env["dtypes"], env["threads"], "WanImageToVideoPipeline"))
            baseline.run(warm)
            record = baseline.run(self.request, return_frames=True)
        finally:
            baseline.close()
        self.frames[label] = record.pop("frames")
        return {"status": "ok", **_timed(record)}


def _compare(out: dict[str, Any], frames: dict[str, Any]) -> None:
    """Per-step ratios against diffusers; frames against diffusers (bounded in float32) and the fast paths' PSNR
    against distvideo's plain frames (its dtypes, no fast path)."""
    from gpu_check_more import psnr
    from gpu_check_phases import frame_diff

    runs = out["runs"]
    reference = runs.get("diffusers", {}).get("denoising_per_step_s")
    base = frames.get("distvideo")
    for label, run in runs.items():
        if run["status"] != "ok":
            continue
        if reference:
            run["per_step_vs_diffusers"] = round(run["denoising_per_step_s"] / reference, 3)
        if base is not None and label not in ("distvideo", "diffusers") and label in frames:
            run["psnr_db_vs_distvideo"] = psnr(frames[label], base)
            run["vs_distvideo"] = frame_diff(frames[label], base)
    if base is not None and "diffusers" in frames:
        diff = frame_diff(base, frames["diffusers"])
        out["distvideo_vs_diffusers"] = diff
        if (out["dtypes"] or {}).get("transformer") == "float32":
            bounded = diff["max_abs_diff"] is not None and diff["max_abs_diff"] <= FLOAT32_BOUND
            out["status"] = "ok" if bounded else "failed"


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def resume_phase(sizes: Any, large: str, guard: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    from distvideo.config import EngineConfig

    if "checkpoint_every" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        return {
            "status": "skipped",
            "reason": "denoising checkpoints (issue 54) have not landed: EngineConfig has no checkpoint_every",
            "not_landed": True,  # not a gap in this run: `complete` does not count it
        }
    return {"status": "error", "error": "the resume phase is not written yet: write it with issue 54's checkpoints"}


def markdown_lines(phase: dict[str, Any]) -> list[str]:
    if not phase.get("runs"):
        return []
    lines = ["", f"## Wan2.1-I2V-14B shapes, {phase['shape']}, {phase['steps']} steps, guidance 5 (random weights)"]
    versus = phase.get("distvideo_vs_diffusers") or {}
    lines += [
        "",
        f"{phase.get('device')}, transformer in {(phase.get('dtypes') or {}).get('transformer')}; the checkpoint "
        f"({phase['gigabytes']} GB) drawn on the device and written in {phase['build_s']} s; distvideo's frames "
        f"against diffusers': max {versus.get('max_abs_diff')}, mean {versus.get('mean_abs_diff')}",
        "",
    ]
    lines += ["| setting | s/step | vs diffusers | end to end (s) | peak memory (GiB) | MFU | PSNR vs distvideo (dB) |"]
    lines += ["| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, run in phase["runs"].items():
        if run["status"] != "ok":
            lines.append(
                f"| {label} | {run['status']}: {(run.get('reason') or run.get('error', '')).replace('|', '/')} |"
            )
            continue
        cells = [
            f"{run['denoising_per_step_s']:.3f}",
            f"{run['per_step_vs_diffusers']:.3f}" if "per_step_vs_diffusers" in run else "",
            f"{run['e2e_s']:.2f}",
            f"{run['peak_memory_mb'] / 1024:.1f}",
            f"{100 * run['mfu']:.1f}%",
            f"{run['psnr_db_vs_distvideo']:.1f}" if "psnr_db_vs_distvideo" in run else "",
        ]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines
