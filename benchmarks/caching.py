"""Step caching on the trained demo model (docs/caching.md): denoising time against uncached, PSNR and SSIM of the
frames against the uncached frames, and the caption pass rate (distvideo.testing.video_check, as
scripts/demo_model_report.py judges the demo model), for each method at each threshold; in the same run diffusers'
own FirstBlockCacheConfig, MagCacheConfig and (`--taylorseer`) TaylorSeerCacheConfig hooks on its WanPipeline with
the same model, seeds and step counts (MagCache with the ratios `distvideo calibrate` stored beside the model); and
the cache under sp2 and cfg2 (mp, two ranks) against the same layout uncached. `--thresholds-mag default` is mag with
no threshold given (its default for the step count).

    python benchmarks/caching.py --steps 20 50 --captions 168 --workers 2 --timed-captions 6 --repeats 3
    python benchmarks/caching.py --steps 20 --captions 6 --timed-captions 2 --repeats 1 --layouts   # reduced scope

Two phases, so that the quality figures cover every caption and the times come from a quiet machine:
1. Quality: every setting on each of `--captions` captions (a seeded sample of the 168; all 168 by default), split
   over `--workers` processes (the figures do not depend on the load). Skipped steps, PSNR, SSIM, captions pass.
2. Time, in one process after phase 1 (nothing else of this benchmark running): the first `--timed-captions`
   captions, `--repeats` rounds, each round running every setting once in turn, so that machine drift hits every
   setting alike; the denoising column is the median over those runs. Then the same for each `--layouts` entry on
   the mp executor (distvideo's settings only), where every rank's own list of skipped steps (collective_rpc of
   execute_forward: each rank's report) must equal the inline run's.
The model's request defaults (17 frames, 64 x 64, guidance 5), float32, one thread per rank. Prints one markdown
table per step count and one for the layouts; `--json` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DISTVIDEO_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import numpy as np
import torch
import torch.nn.functional as F

from distvideo import VideoGenerator
from distvideo.bench.baseline import DiffusersSpec, _DiffusersTimer
from distvideo.models.cache_ratios import METHOD_DEFAULTS, ratios_key, scheduler_name
from distvideo.models.embedded import DEMO_MODEL_DIR
from distvideo.models.registry import probe_model
from distvideo.request import GenerationRequest
from distvideo.testing.shapes import all_captions
from distvideo.testing.video_check import check_video

LAYOUTS = {"sp2": dict(sp_size=2, cfg_parallel=False), "cfg2": dict(cfg_parallel=True, sp_size=1)}
Setting = tuple[str, str | None, float | None]  # (engine, method, threshold: None for the method's default)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray, window: int = 7) -> float:
    """Mean SSIM of the grey frames over a uniform `window` x `window` window (Wang et al. 2004 constants)."""
    x = torch.from_numpy(a.astype(np.float64).mean(-1))[:, None]  # (T, 1, H, W)
    y = torch.from_numpy(b.astype(np.float64).mean(-1))[:, None]
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = F.avg_pool2d(x, window, 1), F.avg_pool2d(y, window, 1)
    vx = F.avg_pool2d(x * x, window, 1) - mx**2
    vy = F.avg_pool2d(y * y, window, 1) - my**2
    cxy = F.avg_pool2d(x * y, window, 1) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(s.mean())


def diffusers_cache(
    timer: _DiffusersTimer, method: str | None, threshold: float | None, steps: int, ratios: list[float]
) -> None:
    """diffusers' own hook for the method, with distvideo's defaults where the setting leaves them (METHOD_DEFAULTS:
    the threshold for the step count; taylorseer's warmup and its forecast steps per computed one, diffusers'
    cache_interval minus 1, its factors in float32 as the model runs)."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    transformer = timer.pipe.transformer
    if transformer.is_cache_enabled:
        transformer.disable_cache()
    if method is None:
        return
    defaults = METHOD_DEFAULTS[method]
    if threshold is None and defaults.threshold is not None:
        threshold = defaults.threshold(steps)
    if method == "first-block":
        transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    elif method == "mag":
        transformer.enable_cache(MagCacheConfig(threshold=threshold, num_inference_steps=steps, mag_ratios=ratios))
    elif method == "taylorseer":  # lite mode: every block skipped, proj_out's output forecast (as ours does)
        assert defaults.max_skip is not None
        config = TaylorSeerCacheConfig(
            cache_interval=defaults.max_skip + 1,
            disable_cache_before_step=max(1, round(defaults.warmup_fraction * steps)),
            taylor_factors_dtype=torch.float32,
            use_lite_mode=True,
        )
        transformer.enable_cache(config)


def settings(args: argparse.Namespace) -> list[Setting]:
    out: list[Setting] = [("distvideo", None, None), ("diffusers", None, None)]
    for engine in ("distvideo", "diffusers"):
        out += [(engine, "first-block", t) for t in args.thresholds_fb]
        out += [(engine, "mag", t) for t in args.thresholds_mag]
        out += [(engine, "taylorseer", None)] if args.taylorseer else []
    return out


def threshold_arg(text: str) -> float | None:
    return None if text == "default" else float(text)


def shown_threshold(setting: Setting) -> str:
    _, method, threshold = setting
    return "-" if method is None or method == "taylorseer" else "default" if threshold is None else str(threshold)


def key(setting: Setting) -> str:
    engine, method, _ = setting
    return f"{engine}/{method or 'none'}/{shown_threshold(setting)}"


class Runner:
    """One inline distvideo engine and one diffusers pipeline on the model, one thread each."""

    def __init__(self, model: Path):
        torch.set_num_threads(1)
        self.info = probe_model(str(model))
        self.timer = _DiffusersTimer(
            DiffusersSpec(
                model=str(model),
                device="cpu",
                dtypes=dict.fromkeys(("transformer", "vae", "text_encoder"), "float32"),
                threads=1,
            )
        )
        self.gen = VideoGenerator.from_pretrained(str(model), device="cpu", executor="inline")

    def ratios(self, steps: int) -> list[float]:
        return self.info.cache_ratios.get(ratios_key(scheduler_name(self.info.index), steps), [])

    def run(self, setting: Setting, text: str, seed: int, steps: int) -> tuple[np.ndarray, float, float]:
        """(frames, denoising seconds, skipped steps: NaN for diffusers, whose hooks do not report them)."""
        engine, method, threshold = setting
        if engine == "distvideo":
            return run_distvideo(self.gen, setting, text, seed, steps)[:3]
        diffusers_cache(self.timer, method, threshold, steps, self.ratios(steps))
        request = GenerationRequest(prompt=text, seed=seed, num_inference_steps=steps)
        out = self.timer.run(self.info.resolve_request(request), return_frames=True)
        return out["frames"], out["stages"]["denoising"], float("nan")

    def close(self) -> None:
        self.gen.shutdown()  # the diffusers pipeline is this process's own: nothing to stop


def run_distvideo(gen: VideoGenerator, setting: Setting, text: str, seed: int, steps: int):
    """(frames, denoising seconds, skipped steps) of the output rank, and every rank's list of skipped steps."""
    _, method, threshold = setting
    extra: dict[str, Any] = {} if method is None else {"cache": method}
    if method is not None and threshold is not None:
        extra["cache_threshold"] = threshold
    request = GenerationRequest(prompt=text, seed=seed, num_inference_steps=steps, save_video=False, **extra)
    outputs = gen.collective_rpc("execute_forward", args=(gen.model_info.resolve_request(request),))
    every_rank = [out.cache["skipped_steps"] if out.cache else [] for out in outputs]
    return outputs[0].frames, outputs[0].timings["denoising"], float(len(every_rank[0])), every_rank


def quality(args: argparse.Namespace, captions: list[int]) -> dict[str, Any]:
    """Phase 1 on these caption indices: {steps: {setting key: {"psnr", "ssim", "ok", "skipped": [per caption]}}}."""
    runner = Runner(args.model)
    everything = all_captions()
    out: dict[str, Any] = {}
    try:
        for steps in args.steps:
            rows: dict[str, dict[str, list[float]]] = {}
            for index in captions:
                caption = everything[index]
                reference: dict[str, np.ndarray] = {}
                for setting in settings(args):
                    frames, _, skipped = runner.run(setting, caption.text, args.seed, steps)
                    if setting[1] is None:
                        reference[setting[0]] = frames
                    row = rows.setdefault(key(setting), {"psnr": [], "ssim": [], "ok": [], "skipped": []})
                    row["psnr"].append(psnr(frames, reference[setting[0]]))
                    row["ssim"].append(ssim(frames, reference[setting[0]]))
                    row["ok"].append(float(check_video(frames, caption).ok))
                    row["skipped"].append(skipped)
            out[str(steps)] = rows
    finally:
        runner.close()
    return out


def quality_in_workers(args: argparse.Namespace, captions: list[int]) -> dict[str, Any]:
    """Phase 1 split over `args.workers` processes of this script (`--quality-shard`), merged in caption order."""
    if args.workers <= 1:
        return quality(args, captions)
    with tempfile.TemporaryDirectory(prefix="caching-") as tmp:
        procs, outs = [], []
        for worker in range(args.workers):
            out = Path(tmp) / f"{worker}.json"
            shard = captions[worker :: args.workers]
            command = [sys.executable, __file__, "--quality-shard", ",".join(map(str, shard)), "--json", str(out)]
            command += ["--model", str(args.model), "--seed", str(args.seed), "--steps", *map(str, args.steps)]
            command += ["--thresholds-fb", *map(str, args.thresholds_fb)]
            command += ["--thresholds-mag", *("default" if t is None else str(t) for t in args.thresholds_mag)]
            command += ["--taylorseer"] if args.taylorseer else []
            procs.append(subprocess.Popen(command))
            outs.append(out)
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("a quality worker failed")
        parts = [json.loads(out.read_text()) for out in outs]
    merged: dict[str, Any] = {}
    for part in parts:  # caption order is not kept across workers; every figure below is a median or a mean
        for steps, rows in part.items():
            for name, row in rows.items():
                target = merged.setdefault(steps, {}).setdefault(name, {k: [] for k in row})
                for k, values in row.items():
                    target[k] += values
    return merged


def timing(args: argparse.Namespace, captions: list[int]) -> dict[str, Any]:
    """Phase 2: {steps: {setting key: [denoising seconds]}}, `repeats` rounds over the captions, settings in turn."""
    runner = Runner(args.model)
    everything = all_captions()
    out: dict[str, Any] = {}
    try:
        for steps in args.steps:
            times: dict[str, list[float]] = {}
            runner.run(settings(args)[0], everything[captions[0]].text, args.seed, steps)  # warm-up
            for _ in range(args.repeats):
                for index in captions:
                    for setting in settings(args):
                        _, seconds, _ = runner.run(setting, everything[index].text, args.seed, steps)
                        times.setdefault(key(setting), []).append(seconds)
            out[str(steps)] = times
    finally:
        runner.close()
    return out


def layouts(args: argparse.Namespace, captions: list[int]) -> dict[str, Any]:
    """Each layout on mp against the same layout uncached: {layout: {steps: {setting key: {"t", "skipped",
    "max_diff"}}}}; every rank's list of skipped steps must equal the inline run's (each rank's own report, through
    collective_rpc), the frames within 2 of inline."""
    everything = all_captions()
    ours = [s for s in settings(args) if s[0] == "distvideo"]
    inline: dict[tuple[int, str, int], tuple[np.ndarray, list[int]]] = {}
    with VideoGenerator.from_pretrained(str(args.model), device="cpu", executor="inline") as gen:
        for steps in args.steps:
            for index in captions:
                for setting in ours:
                    frames, _, _, ranks = run_distvideo(gen, setting, everything[index].text, args.seed, steps)
                    inline[(steps, key(setting), index)] = (frames, ranks[0])
    out: dict[str, Any] = {}
    for name in args.layouts:
        with VideoGenerator.from_pretrained(
            str(args.model), device="cpu", executor="mp", num_gpus=2, **LAYOUTS[name]
        ) as gen:
            for steps in args.steps:
                rows: dict[str, dict[str, list[float]]] = {}
                run_distvideo(gen, ours[0], everything[captions[0]].text, args.seed, steps)  # warm-up
                for _ in range(args.repeats):
                    for index in captions:
                        for setting in ours:
                            frames, seconds, skipped, ranks = run_distvideo(
                                gen, setting, everything[index].text, args.seed, steps
                            )
                            ref_frames, ref_steps = inline[(steps, key(setting), index)]
                            row = rows.setdefault(key(setting), {"t": [], "skipped": [], "max_diff": []})
                            row["t"].append(seconds)
                            row["skipped"].append(skipped)
                            row["max_diff"].append(float(np.abs(frames.astype(int) - ref_frames.astype(int)).max()))
                            if any(steps_of_rank != ref_steps for steps_of_rank in ranks):
                                raise SystemExit(f"{name} {key(setting)}: skipped {ranks} by rank, inline {ref_steps}")
                out.setdefault(name, {})[str(steps)] = rows
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_tables(args: argparse.Namespace, report: dict[str, Any]) -> None:
    for steps in map(str, args.steps):
        q, t = report["quality"][steps], report["timing"][steps]
        print(f"\n{steps} steps: quality over {report['captions']} captions, times over {report['timed_captions']} x "
              f"{args.repeats} runs (seed {args.seed})")  # fmt: skip
        print(
            "| engine | cache | threshold | skipped steps | denoising (s) | vs uncached | PSNR (dB) | SSIM | captions pass |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for setting in settings(args):
            name, engine = key(setting), setting[0]
            base, now = median(t[key((engine, None, None))]), median(t[name])
            row = q[name]
            finite = [p for p in row["psnr"] if np.isfinite(p)]
            shown = (
                "identical"
                if not finite
                else f"{median(finite):.1f}" + ("" if len(finite) == len(row["psnr"]) else "*")
            )
            skipped = [s for s in row["skipped"] if np.isfinite(s)]
            print(
                f"| {engine} | {setting[1] or 'none'} | {shown_threshold(setting)} | "
                f"{f'{median(skipped):.0f}' if skipped else '-'} | {now:.3f} | {base / now:.2f}x | {shown} | "
                f"{median(row['ssim']):.3f} | {100 * statistics.mean(row['ok']):.1f}% |"
            )
    for name, by_steps in report.get("layouts", {}).items():
        for steps, rows in by_steps.items():
            print(f"\n{name} (mp, 2 ranks), {steps} steps, {report['timed_captions']} captions x {args.repeats} runs")
            print(
                "| cache | threshold | skipped steps (= inline) | denoising (s) | vs uncached "
                + name
                + " | max diff vs inline |"
            )
            print("|---|---|---|---|---|---|")
            base = median(rows["distvideo/none/-"]["t"])
            for setting_key, row in rows.items():
                _, method, threshold = setting_key.split("/")
                print(f"| {method} | {threshold} | {median(row['skipped']):.0f} | {median(row['t']):.3f} | "
                      f"{base / median(row['t']):.2f}x | {max(row['max_diff']):.0f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 50])
    parser.add_argument("--captions", type=int, default=168, help="captions for the quality figures (of 168)")
    parser.add_argument("--timed-captions", type=int, default=6, help="the first N of them are also timed")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds over the timed captions")
    parser.add_argument("--workers", type=int, default=1, help="processes for the quality phase")
    parser.add_argument("--layouts", nargs="*", default=["sp2", "cfg2"], choices=sorted(LAYOUTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--thresholds-fb", type=float, nargs="*", default=[0.05, 0.1, 0.2])
    parser.add_argument(
        "--thresholds-mag", type=threshold_arg, nargs="+", default=[None], help="numbers, or default (by step count)"
    )
    parser.add_argument("--taylorseer", action="store_true", help="also taylorseer (distvideo's and diffusers')")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--quality-shard", help=argparse.SUPPRESS)  # a phase-1 worker: these caption indices
    args = parser.parse_args()
    if args.quality_shard is not None:
        report = quality(args, [int(i) for i in args.quality_shard.split(",") if i])
        args.json.write_text(json.dumps(report))
        return
    count = len(all_captions())
    if not 1 <= args.captions <= count or not 1 <= args.timed_captions <= args.captions or args.repeats < 1:
        parser.error(f"need 1 <= --timed-captions <= --captions <= {count} and --repeats >= 1")
    captions = random.Random(args.seed).sample(range(count), args.captions)
    start = time.perf_counter()
    report: dict[str, Any] = {"captions": args.captions, "timed_captions": args.timed_captions, "args": vars(args)}
    report["quality"] = quality_in_workers(args, captions)
    quality_s = time.perf_counter() - start
    report["load_before_timing"] = os.getloadavg()
    report["timing"] = timing(args, captions[: args.timed_captions])
    report["layouts"] = layouts(args, captions[: args.timed_captions]) if args.layouts else {}
    report["load_after_timing"] = os.getloadavg()
    print_tables(args, report)
    print(f"\nquality phase {quality_s:.0f} s, {time.perf_counter() - start:.0f} s in all; load average before the "
          f"timing {report['load_before_timing'][0]:.2f}, after {report['load_after_timing'][0]:.2f}")  # fmt: skip
    if args.json:
        report["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
