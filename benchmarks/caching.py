"""Step caching on the trained demo model (docs/caching.md): denoising time against uncached, PSNR and SSIM of the
frames against the uncached frames, and the caption pass rate (distvideo.testing.video_check, as
scripts/demo_model_report.py judges the demo model), for each method at each threshold; in the same run diffusers'
own FirstBlockCacheConfig and MagCacheConfig hooks on its WanPipeline with the same model, seeds and step counts
(MagCache with the ratios `distvideo calibrate` stored beside the model).

    python benchmarks/caching.py --steps 20 50 --captions 24
    python benchmarks/caching.py --steps 20 --captions 2 --thresholds-fb 0.05 0.1 0.2   # reduced scope

The model's request defaults (17 frames, 64 x 64, guidance 5), one thread per process; each caption's runs follow
each other, so machine drift hits every setting alike. Prints one markdown table per step count.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import numpy as np
import torch
import torch.nn.functional as F

from distvideo import VideoGenerator
from distvideo.bench.baseline import DiffusersSpec, _DiffusersTimer
from distvideo.models.cache_ratios import ratios_key, scheduler_name
from distvideo.models.embedded import DEMO_MODEL_DIR
from distvideo.models.registry import probe_model
from distvideo.request import GenerationRequest
from distvideo.testing.shapes import all_captions
from distvideo.testing.video_check import check_video


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
    timer: _DiffusersTimer, method: str | None, threshold: float, steps: int, ratios: list[float]
) -> None:
    from diffusers import FirstBlockCacheConfig, MagCacheConfig

    transformer = timer.pipe.transformer
    if transformer.is_cache_enabled:
        transformer.disable_cache()
    if method == "first-block":
        transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    elif method == "mag":
        transformer.enable_cache(MagCacheConfig(threshold=threshold, num_inference_steps=steps, mag_ratios=ratios))


def settings(args: argparse.Namespace) -> list[tuple[str, str | None, float]]:
    out: list[tuple[str, str | None, float]] = [("distvideo", None, 0.0), ("diffusers", None, 0.0)]
    for engine in ("distvideo", "diffusers"):
        out += [(engine, "first-block", t) for t in args.thresholds_fb]
        out += [(engine, "mag", t) for t in args.thresholds_mag]
    return out


def run_steps(args: argparse.Namespace, gen: VideoGenerator, timer: _DiffusersTimer, steps: int) -> None:
    info = probe_model(str(args.model))
    ratios = info.cache_ratios.get(ratios_key(scheduler_name(info.index), steps), [])
    captions = random.Random(args.seed).sample(all_captions(), args.captions)
    rows: dict[tuple[str, str | None, float], dict[str, list[float]]] = {}
    for caption in captions:
        reference: dict[str, np.ndarray] = {}
        for engine, method, threshold in settings(args):
            request = GenerationRequest(prompt=caption.text, seed=args.seed, num_inference_steps=steps)
            if engine == "distvideo":
                extra = {} if method is None else {"cache": method, "cache_threshold": threshold}
                result = gen.generate(
                    caption.text, seed=args.seed, num_inference_steps=steps, save_video=False, **extra
                )
                frames, denoising = result.frames, result.timings["denoising"]
                skipped = len(result.cache["skipped_steps"]) if result.cache else 0
            else:
                diffusers_cache(timer, method, threshold, steps, ratios)
                out = timer.run(info.resolve_request(request), return_frames=True)
                frames, denoising, skipped = out["frames"], out["stages"]["denoising"], float("nan")
            assert frames is not None
            if method is None:
                reference[engine] = frames
            row = rows.setdefault((engine, method, threshold), {"t": [], "psnr": [], "ssim": [], "ok": [], "sk": []})
            row["t"].append(denoising)
            row["psnr"].append(psnr(frames, reference[engine]))
            row["ssim"].append(ssim(frames, reference[engine]))
            row["ok"].append(float(check_video(frames, caption).ok))
            row["sk"].append(skipped)
    print(f"\n{steps} steps, {args.captions} captions (seed {args.seed}), load average {os.getloadavg()[0]:.1f}")
    print(
        "| engine | cache | threshold | skipped steps | denoising (s) | vs uncached | PSNR (dB) | SSIM | captions pass |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (engine, method, threshold), row in rows.items():
        base = statistics.median(rows[(engine, None, 0.0)]["t"])
        t = statistics.median(row["t"])
        finite = [p for p in row["psnr"] if np.isfinite(p)]
        shown_psnr = f"{statistics.median(finite):.1f}" if finite else "identical"
        print(
            f"| {engine} | {method or 'none'} | {threshold if method else '-'} | {statistics.median(row['sk']):.0f} | "
            f"{t:.2f} | {base / t:.2f}x | {shown_psnr} | {statistics.median(row['ssim']):.3f} | "
            f"{100 * statistics.mean(row['ok']):.0f}% |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 50])
    parser.add_argument("--captions", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--thresholds-fb", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--thresholds-mag", type=float, nargs="+", default=[0.03, 0.06, 0.12])
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = DiffusersSpec(
        model=str(args.model),
        device="cpu",
        dtypes=dict.fromkeys(("transformer", "vae", "text_encoder"), "float32"),
        threads=1,
    )
    timer = _DiffusersTimer(spec)
    start = time.perf_counter()
    with VideoGenerator.from_pretrained(str(args.model), device="cpu", executor="inline") as gen:
        for steps in args.steps:
            run_steps(args, gen, timer, steps)
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
