"""The few_step phase of benchmarks/gpu_check.py (issue 56): a step-distilled request against the guided one.

On the large checkpoint at the first timed shape, one inline engine: the guided request Wan's defaults ask for
(FEW_STEP_BASE steps, guidance 5, the checkpoint's UniPC), then the request a step- and guidance-distilled Wan runs
(LightX2V's StepDistill schedule: 4 Euler steps at timesteps 1000, 750, 500, 250, flow shift 5, guidance 1: one
branch). Denoising and end-to-end time of each and the ratio. Random weights: what is timed is the schedule's cost,
not a distilled model's quality (docs/demo-model.md measures that on the 4-step demo model).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

FEW_STEP_BASE = {"gpu": 50, "smoke": 8}  # the guided baseline's steps (Wan2.1's default on a GPU)


def few_step_phase(sizes: Any, large: str, guard: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    from gpu_check_more import _timed
    from gpu_check_phases import bench_plan

    from distvideo.bench.measure import distvideo_run
    from distvideo.generator import VideoGenerator
    from distvideo.testing.distilled import LIGHTX2V_STEP_DISTILL

    shape = sizes.shapes[0]
    base_steps = FEW_STEP_BASE[sizes.mode]
    plan = bench_plan(large, sizes, shape, base_steps, compare=False)
    guided = dataclasses.replace(plan.request, save_video=False, return_frames=False)
    few = dataclasses.replace(guided, **LIGHTX2V_STEP_DISTILL)
    key = f"{shape['num_frames']}x{shape['height']}x{shape['width']}"
    out: dict[str, Any] = {"status": "ok", "shape": key, "schedule": dict(LIGHTX2V_STEP_DISTILL), "runs": {}}
    with VideoGenerator.from_engine(plan.engine) as gen:
        distvideo_run(gen, dataclasses.replace(few, num_inference_steps=2, timesteps=[1000, 500]))  # warm-up
        began = time.monotonic()
        record, _ = distvideo_run(gen, few)
        out["runs"]["4 steps, no guidance"] = _timed(record)
        one = time.monotonic() - began
        if guard.left() < one * 2 * base_steps / 4 + 5:  # the guided run: twice the forwards a step, more steps
            out["runs"][f"{base_steps} steps, guided"] = {"status": "skipped", "reason": f"{guard.left():.0f} s left"}
            return out
        reference, _ = distvideo_run(gen, guided)
        out["runs"][f"{base_steps} steps, guided"] = _timed(reference)
    out["speedup_denoising"] = round(reference["stages"]["denoising"] / record["stages"]["denoising"], 2)
    out["speedup_e2e"] = round(reference["e2e_s"] / record["e2e_s"], 2)
    progress(f"few_step: {out['speedup_denoising']:.1f}x denoising, {out['speedup_e2e']:.1f}x end to end")
    return out
