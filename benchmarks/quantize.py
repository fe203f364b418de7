"""Low-precision weights (`--quantize`, docs/performance.md): what each mode costs in quality and what it saves.

Three phases (`--phases`, all by default):

- **quality**, on the trained demo model at its request defaults (20 steps, guidance 5, 17 frames of 64 x 64,
  float32): for every mode that runs on this CPU, PSNR and SSIM of its frames against the unquantized frames of the
  same caption and seed, and the caption pass rate (distvideo.testing.video_check, as scripts/demo_model_report.py
  judges the demo model) over `--captions` of the 168 captions, split over `--workers` processes (the figures do not
  depend on the load).
- **speed**, on the weight-dominated random checkpoint of the sharding benchmark (8 layers, 1024 wide), one rank:
  the weights of the transformer per rank and the denoising time per step of each mode against the unquantized model
  in the same dtype, in `--rounds` interleaved rounds (each round runs every mode once, so drift hits all alike);
  medians. Run on a quiet machine (nothing else of this benchmark runs meanwhile).
- **layouts**: int8 under cfg2 x sp2 (mp, four ranks) on the demo model: every rank's weight report, and the frames
  against the single-rank int8 frames (another layout: within 2 is the promise).

    python benchmarks/quantize.py --captions 168 --workers 2 --rounds 5 --json quantize.json
    python benchmarks/quantize.py --phases quality --captions 12 --workers 1      # a quick look

Prints markdown tables; `--json` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from caching import psnr, ssim  # the same quality measures as the step cache's figures

from distvideo import VideoGenerator
from distvideo.models.embedded import DEMO_MODEL_DIR
from distvideo.testing.checkpoints import build_sharding_checkpoint
from distvideo.testing.shapes import all_captions
from distvideo.testing.video_check import check_video

CPU_MODES = ("none", "int8", "int8-weight", "fp8-weight")
SPEED_REQUEST = dict(
    num_frames=9, height=256, width=256, num_inference_steps=2, guidance_scale=5.0, seed=0
)  # 768 tokens


def quality(captions: list[int]) -> dict[str, dict[str, list[float]]]:
    """{mode: {"psnr", "ssim", "ok": [per caption]}} on these caption indices, one thread."""
    everything = all_captions()
    gens = {m: VideoGenerator.from_pretrained(executor="inline", quantize=m, progress=False) for m in CPU_MODES}
    rows: dict[str, dict[str, list[float]]] = {m: {"psnr": [], "ssim": [], "ok": []} for m in CPU_MODES}
    try:
        for index in captions:
            caption = everything[index]
            reference = None
            for mode, gen in gens.items():
                frames = gen.generate(caption.text, seed=index, save_video=False).frames
                reference = frames if reference is None else reference
                rows[mode]["psnr"].append(psnr(frames, reference))
                rows[mode]["ssim"].append(ssim(frames, reference))
                rows[mode]["ok"].append(float(check_video(frames, caption).ok))
    finally:
        for gen in gens.values():
            gen.shutdown()
    return rows


def quality_in_workers(captions: list[int], workers: int) -> dict[str, dict[str, list[float]]]:
    """`quality` split over `workers` processes of this script (`--quality-shard`); figures in caption order."""
    with tempfile.TemporaryDirectory(prefix="quantize-") as tmp:
        procs, outs, shards = [], [], []
        for worker in range(workers):
            shard = captions[worker::workers]
            out = Path(tmp) / f"{worker}.json"
            command = [sys.executable, __file__, "--quality-shard", ",".join(map(str, shard)), "--json", str(out)]
            env = {**os.environ, "DISTVIDEO_NUM_THREADS": "1", "DISTVIDEO_LOG_LEVEL": "WARNING"}
            procs.append(subprocess.Popen(command, env=env))
            outs.append(out)
            shards.append(shard)
        if any(proc.wait() != 0 for proc in procs):
            raise SystemExit("a quality worker failed")
        parts = [(shard, json.loads(out.read_text())) for shard, out in zip(shards, outs, strict=True)]
    merged: dict[str, dict[str, list[float]]] = {m: {"psnr": [], "ssim": [], "ok": []} for m in CPU_MODES}
    order = sorted((index, part, i) for shard, part in parts for i, index in enumerate(shard))
    for _, part, i in order:
        for mode in CPU_MODES:
            for key in ("psnr", "ssim", "ok"):
                merged[mode][key].append(part[mode][key][i])
    return merged


def speed(rounds: int, dtypes: list[str]) -> dict[str, Any]:
    """{dtype: {mode: {"weights_mb", "per_step_s" (median), "runs"}}} on the weight-dominated checkpoint."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="quantize-speed-") as tmp:
        model = build_sharding_checkpoint(Path(tmp) / "ckpt")
        for dtype in dtypes:
            gens = {
                m: VideoGenerator.from_pretrained(
                    str(model), executor="inline", quantize=m, dtype=dtype, progress=False
                )
                for m in CPU_MODES
            }
            runs: dict[str, list[float]] = {m: [] for m in CPU_MODES}
            weights: dict[str, float] = {}
            try:
                for gen in gens.values():  # warm-up
                    gen.generate(
                        "a lighthouse in a storm", save_video=False, **{**SPEED_REQUEST, "num_inference_steps": 1}
                    )
                for _ in range(rounds):
                    for mode, gen in gens.items():
                        result = gen.generate("a lighthouse in a storm", save_video=False, **SPEED_REQUEST)
                        runs[mode].append(result.timings["denoising"] / SPEED_REQUEST["num_inference_steps"])
                        weights[mode] = result.weights["transformer"]["bytes"] / 2**20
            finally:
                for gen in gens.values():
                    gen.shutdown()
            out[dtype] = {
                m: {"weights_mb": weights[m], "per_step_s": statistics.median(runs[m]), "runs": runs[m]}
                for m in CPU_MODES
            }
    return out


def layouts() -> dict[str, Any]:
    """int8 under cfg2 x sp2 on mp against one rank's int8 frames, with every rank's weight report."""
    request = dict(seed=3, save_video=False)
    text = all_captions()[0].text
    with VideoGenerator.from_pretrained(executor="inline", quantize="int8", progress=False) as gen:
        single = gen.generate(text, **request)
    with VideoGenerator.from_pretrained(
        executor="mp", num_gpus=4, cfg_parallel=True, sp_size=2, quantize="int8", progress=False
    ) as gen:
        result = gen.generate(text, **request)
        reports = gen.collective_rpc(lambda worker: worker.weights)
    diff = int(np.abs(result.frames.astype(np.int16) - single.frames.astype(np.int16)).max())
    return {"layout": "cfg2 x sp2 (mp)", "max_abs_diff_vs_single_rank": diff, "weights_per_rank": reports}


def print_quality(rows: dict[str, dict[str, list[float]]]) -> None:
    count = len(rows["none"]["ok"])
    print(f"\nquality on the demo model ({count} captions, 20 steps, guidance 5; against the unquantized frames)\n")
    print("| mode | PSNR (dB, median) | PSNR (min) | SSIM (mean) | captions pass |")
    print("|---|---|---|---|---|")
    for mode, row in rows.items():
        finite = [p for p in row["psnr"] if np.isfinite(p)]
        median = f"{statistics.median(finite):.1f}" if finite else "exact"
        low = f"{min(finite):.1f}" if finite else "exact"
        passed = sum(row["ok"])
        print(
            f"| {mode} | {median} | {low} | {statistics.fmean(row['ssim']):.4f} | "
            f"{passed:.0f}/{count} ({100 * passed / count:.1f}%) |"
        )


def print_speed(figures: dict[str, Any]) -> None:
    for dtype, modes in figures.items():
        base = modes["none"]
        print(f"\nspeed on the weight-dominated checkpoint, {dtype}, one rank (median per denoising step)\n")
        print("| mode | transformer weights (MiB) | x unquantized | per step (s) | speedup |")
        print("|---|---|---|---|---|")
        for mode, row in modes.items():
            print(
                f"| {mode} | {row['weights_mb']:.1f} | {row['weights_mb'] / base['weights_mb']:.2f} | "
                f"{row['per_step_s']:.3f} | {base['per_step_s'] / row['per_step_s']:.2f}x |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", nargs="+", default=["quality", "speed", "layouts"])
    parser.add_argument("--captions", type=int, default=168, help="the first N of the 168 captions")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quality-shard", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quality_shard is not None:  # a worker of quality_in_workers
        args.json.write_text(json.dumps(quality([int(i) for i in args.quality_shard.split(",")])))
        return
    report: dict[str, Any] = {"model": str(DEMO_MODEL_DIR), "date": time.strftime("%Y-%m-%d"), "load": os.getloadavg()}
    if "quality" in args.phases:
        report["quality"] = quality_in_workers(list(range(args.captions)), args.workers)
        print_quality(report["quality"])
    if "speed" in args.phases:
        report["load_before_speed"] = os.getloadavg()
        report["speed"] = speed(args.rounds, args.dtypes)
        print_speed(report["speed"])
    if "layouts" in args.phases:
        report["layouts"] = layouts()
        print(f"\nlayouts: {json.dumps(report['layouts'])}")
    print(f"\nload average at the start {report['load']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
