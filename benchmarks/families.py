"""`distvideo bench --compare diffusers` on every model family, on one rank, with benchmark-sized random checkpoints.

For each family a 4-layer checkpoint 256 wide (4 heads x 64; VAE base width 16) is built once into
`--folder` (distvideo.testing.families; HunyuanVideo 1.5: distvideo.testing.hunyuan), then `distvideo bench` runs
distvideo and the matching diffusers pipeline (WanPipeline, or WanImageToVideoPipeline with an image; the
checkpoint's HunyuanVideo15Pipeline or HunyuanVideo15ImageToVideoPipeline) interleaved run by run, and the table below is printed from
the JSON reports (medians of the per-run ratios distvideo / diffusers). Each family's bench runs in its own process.

    python benchmarks/families.py --runs 5 --warmup 1 --out bench-families
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

WIDTH = dict(num_layers=4, num_attention_heads=4, attention_head_dim=64, text_dim=64, vae_base_dim=16)
# family -> (with an image, request flags)
FAMILIES = {
    "wan21_i2v": (True, ["--num-frames", "9", "--height", "96", "--width", "96", "--steps", "6"]),
    "wan22_t2v_a14b": (False, ["--num-frames", "9", "--height", "96", "--width", "96", "--steps", "6"]),
    "wan22_i2v_a14b": (True, ["--num-frames", "9", "--height", "96", "--width", "96", "--steps", "6"]),
    "wan22_ti2v_5b": (True, ["--num-frames", "9", "--height", "96", "--width", "96", "--steps", "6"]),
    # HunyuanVideo 1.5 (distvideo.testing.hunyuan): diffusers sizes image-to-video by the image's bucket at the
    # transformer's target size (96: 80 x 96 for the 160 x 120 image), so that request gives no size
    "hunyuan15_t2v": (False, ["--num-frames", "9", "--height", "96", "--width", "96", "--steps", "6"]),
    "hunyuan15_i2v": (True, ["--num-frames", "9", "--steps", "6"]),
}
HUNYUAN_WIDTH = dict(num_layers=4, num_attention_heads=4, attention_head_dim=64, text_dim=64, vae_base_dim=16)
ROWS = [
    ("end to end (s)", "e2e_s"),
    ("text encoding (s)", "text_encoding"),
    ("denoising (s)", "denoising"),
    ("decoding (s)", "decoding"),
    ("peak memory (MiB)", "peak_memory_mb"),
]


def build(folder: Path) -> dict[str, Path]:
    from distvideo.testing.families import build_family_checkpoint, write_test_image
    from distvideo.testing.hunyuan import build_hunyuan_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for family in FAMILIES:
        path = folder / family
        if not (path / "model_index.json").is_file():
            if family.startswith("hunyuan15"):
                i2v = family.endswith("i2v")
                build_hunyuan_checkpoint(path, seed=21, image_to_video=i2v, target_size=96, **HUNYUAN_WIDTH)
            else:
                build_family_checkpoint(family, path, scheduler="unipc", seed=21, **WIDTH)
        paths[family] = path
    if not (folder / "image.png").is_file():
        write_test_image(folder / "image.png", width=160, height=120, seed=1)
    return paths


def figure(report: dict, side: str, key: str) -> float:
    figures = report[side]
    return figures[key] if key in ("e2e_s", "peak_memory_mb") else figures["stages"][key]


def table(reports: dict[str, dict]) -> str:
    lines = ["| family | figure | distvideo | diffusers | ratio (median) | per-run min-max |", "| --- | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for family, report in reports.items():
        for label, key in ROWS:
            lo, hi = report["ratios_range"][key]
            lines.append(
                f"| {family} | {label} | {figure(report, 'distvideo', key):.3f} | {figure(report, 'diffusers', key):.3f}"
                f" | {report['ratios'][key]:.3f} | {lo:.2f}-{hi:.2f} |"
            )
        lines.append(f"| {family} | frames max abs diff | | | {report['check']['frames_max_abs_diff']} | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--folder", default="/tmp/distvideo-benchmark-families", help="where the checkpoints go")
    parser.add_argument("--out", default="bench-families", help="folder for the JSON reports")
    parser.add_argument("--only", nargs="*", choices=list(FAMILIES), help="these families only")
    args = parser.parse_args()
    paths = build(Path(args.folder))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for family, (image, flags) in FAMILIES.items():
        if args.only and family not in args.only:
            continue
        cmd = [sys.executable, "-m", "distvideo", "bench", "--model", str(paths[family]), *flags]
        cmd += ["--image", str(Path(args.folder) / "image.png")] if image else []
        cmd += ["--runs", str(args.runs), "--warmup", str(args.warmup), "--compare", "diffusers", "--no-progress"]
        cmd += ["--json", str(out / f"{family}.json")]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        reports[family] = json.loads((out / f"{family}.json").read_text())
    print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
