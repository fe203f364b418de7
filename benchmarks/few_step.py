"""The 4-step demo model against its teacher (docs/demo-model.md, "The 4-step model"): time and quality.

- **speed**: the teacher (the demo model: 20 UniPC steps, guidance 5, two forwards a step) and the student
  (`demo-4step`: 4 Euler steps, one branch) at their own defaults, one rank inline, `--rounds` interleaved rounds over
  the same captions (each round runs both, so drift hits both alike); medians of the denoising time and of the whole
  request, and their ratios.
- **quality**: over `--captions` captions (seed 0, as scripts/demo_model_report.py), the caption pass rate of each and
  the student's PSNR and SSIM against the teacher's frames of the same caption (the exact output it imitates), with
  the undistilled demo model run at the student's schedule beside it (what distillation adds).

    python benchmarks/few_step.py --rounds 7 --captions 168 --json few_step.json

Run on a quiet machine (check the load average). Prints markdown tables; `--json` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from caching import psnr, ssim  # the same quality measures as the step cache's figures

from distvideo import VideoGenerator
from distvideo.models.embedded import DEMO_4STEP_MODEL_DIR, DEMO_MODEL_DIR
from distvideo.testing.shapes import all_captions
from distvideo.testing.video_check import check_video


def student_schedule() -> dict[str, Any]:
    declared = json.loads((DEMO_4STEP_MODEL_DIR / "distvideo_defaults.json").read_text())
    keys = ("num_inference_steps", "guidance_scale", "scheduler", "flow_shift", "sigmas")
    return {k: declared[k] for k in keys}


def speed(rounds: int, prompts: list[str]) -> dict[str, Any]:
    gens = {
        "teacher": VideoGenerator.from_pretrained(DEMO_MODEL_DIR, executor="inline", progress=False),
        "student": VideoGenerator.from_pretrained(DEMO_4STEP_MODEL_DIR, executor="inline", progress=False),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"denoising": [], "total": []} for k in gens}
    try:
        for gen in gens.values():  # a warm-up each
            gen.generate(prompts[0], save_video=False)
        for _ in range(rounds):
            for prompt in prompts:
                for name, gen in gens.items():
                    res = gen.generate(prompt, save_video=False)
                    times[name]["denoising"].append(res.timings["denoising"])
                    times[name]["total"].append(res.timings["total"])
    finally:
        for gen in gens.values():
            gen.shutdown()
    medians = {k: {s: statistics.median(v) for s, v in t.items()} for k, t in times.items()}
    ratios = {s: medians["teacher"][s] / medians["student"][s] for s in ("denoising", "total")}
    return {"median_s": medians, "teacher_over_student": ratios, "runs_each": rounds * len(prompts)}


def quality(count: int) -> dict[str, Any]:
    captions = all_captions()[:count] if count < 168 else all_captions()
    schedule = student_schedule()
    gens = {
        "teacher": VideoGenerator.from_pretrained(DEMO_MODEL_DIR, executor="inline", progress=False),
        "student": VideoGenerator.from_pretrained(DEMO_4STEP_MODEL_DIR, executor="inline", progress=False),
    }
    rows: dict[str, dict[str, list[float]]] = {k: {"ok": [], "psnr": [], "ssim": []} for k in (*gens, "undistilled")}
    try:
        for caption in captions:
            frames = {name: gen.generate(caption.text, seed=0, save_video=False).frames for name, gen in gens.items()}
            frames["undistilled"] = gens["teacher"].generate(caption.text, seed=0, save_video=False, **schedule).frames
            for name, got in frames.items():
                rows[name]["ok"].append(float(check_video(got, caption).ok))
                rows[name]["psnr"].append(psnr(got, frames["teacher"]))
                rows[name]["ssim"].append(ssim(got, frames["teacher"]))
    finally:
        for gen in gens.values():
            gen.shutdown()
    return {
        name: {
            "passed": int(sum(r["ok"])),
            "of": len(r["ok"]),
            "psnr_median_db": statistics.median(r["psnr"]) if name != "teacher" else None,
            "ssim_median": statistics.median(r["ssim"]) if name != "teacher" else None,
        }
        for name, r in rows.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=3, help="captions per speed round")
    parser.add_argument("--captions", type=int, default=168, help="captions of the quality phase (0: skip it)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    load = os.getloadavg()
    prompts = [c.text for c in all_captions()[:: max(1, 168 // args.prompts)][: args.prompts]]
    started = time.time()
    report: dict[str, Any] = {"load_average": load, "speed": speed(args.rounds, prompts)}
    if args.captions:
        report["quality"] = quality(args.captions)
    report["wall_s"] = time.time() - started
    s = report["speed"]
    print(f"load average at start: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}")
    print("| model | denoising (median s) | request (median s) |\n| --- | ---: | ---: |")
    for name in ("teacher", "student"):
        print(f"| {name} | {s['median_s'][name]['denoising']:.4f} | {s['median_s'][name]['total']:.4f} |")
    ratios = s["teacher_over_student"]
    print(f"teacher / student: denoising {ratios['denoising']:.2f}x, request {ratios['total']:.2f}x")
    if "quality" in report:
        print("| model | captions passed | PSNR vs teacher (median dB) | SSIM (median) |\n| --- | ---: | ---: | ---: |")
        for name, q in report["quality"].items():
            extra = "" if q["psnr_median_db"] is None else f"{q['psnr_median_db']:.1f} | {q['ssim_median']:.3f}"
            print(f"| {name} | {q['passed']} of {q['of']} | {extra or '(itself) | '} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
