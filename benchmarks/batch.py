"""Batch throughput and resume overhead (issue 16; docs/batch.md, docs/BENCHMARKS.md).

Throughput: 8 prompts on the benchmark checkpoint, in one process per layout, one intra-op thread per rank:
``single`` (one rank, inline), ``replicas2`` (2 ranks: 2 replicas of one rank, mp) and ``cfg2`` (2 ranks: one replica
with CFG parallelism, mp). Each layout runs the batch ``--rounds`` times, the layouts interleaved (single, replicas2,
cfg2, single, ...) so load from other processes hits them alike; items per second are the batch's item count over
the wall time of `generate_batch` (loading excluded), medians over the rounds, and ratios against ``single``.
``--sizes`` gives the request sizes (frames x height x width) to compare at.

Resume: a finished batch of ``--resume-items`` items (tiny requests on the tiny random-weight model) is run again with
`distvideo generate --prompts`: the time until the command returns, nothing left to do, no weights loaded.

    python benchmarks/batch.py --rounds 3 --sizes 9x64x64,17x128x128
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

LAYOUTS = {
    "single": {"executor": "inline"},
    "replicas2": {"executor": "mp", "num_gpus": 2, "replicas": 2},
    "cfg2": {"executor": "mp", "num_gpus": 2, "cfg_parallel": True, "sp_size": 1},
}
PROMPTS = [f"a {c} {s} moving left" for c in ("red", "green", "blue", "yellow") for s in ("ball", "square")]


def run_layout(model: str, layout: str, size: str, steps: int) -> float:
    """Items per second of one batch run, in this process (a child of the driver, so each layout starts fresh)."""
    from distvideo import EngineConfig, VideoGenerator

    frames, height, width = map(int, size.split("x"))
    config = EngineConfig(model=model, progress=False, log_level="WARNING", **LAYOUTS[layout])
    with VideoGenerator.from_config(config) as gen, tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        results = gen.generate_batch(
            PROMPTS, output_dir=out, num_frames=frames, height=height, width=width, num_inference_steps=steps,
            guidance_scale=5.0, progress=False,
        )  # fmt: skip
        elapsed = time.perf_counter() - start
    assert all(r.status == "done" for r in results), results
    return len(results) / elapsed


def resume_seconds(items: int) -> dict[str, Any]:
    from distvideo.models.embedded import tiny_model_path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DISTVIDEO_NO_PROGRESS": "1"}
    with tempfile.TemporaryDirectory() as folder:
        prompts = Path(folder) / "prompts.txt"
        prompts.write_text("\n".join(f"prompt number {i}" for i in range(items)) + "\n")
        argv = [sys.executable, "-m", "distvideo", "generate", "--prompts", str(prompts), "--output", f"{folder}/out"]
        argv += ["--model", str(tiny_model_path())]
        argv += ["--num-frames", "5", "--height", "32", "--width", "32", "--steps", "1", "--no-progress"]
        first = time.perf_counter()
        subprocess.run(argv, check=True, env=env, capture_output=True)
        generated = time.perf_counter() - first
        start = time.perf_counter()
        proc = subprocess.run(argv, check=True, env=env, capture_output=True, text=True)
        again = time.perf_counter() - start
    return {"items": items, "first_run_s": generated, "rerun_s": again, "rerun_output": proc.stdout.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help="checkpoint (default: the benchmark checkpoint, built once)")
    parser.add_argument("--sizes", default="9x64x64,17x128x128")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resume-items", type=int, default=100)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    if args.child:
        layout, size = args.child.split(":")
        print(json.dumps({"items_per_s": run_layout(args.model, layout, size, args.steps)}), flush=True)
        return
    if args.model is None:
        from distvideo.testing.checkpoints import build_benchmark_checkpoint

        folder = Path(tempfile.gettempdir()) / "distvideo-benchmark-checkpoint"
        if not (folder / "model_index.json").is_file():
            build_benchmark_checkpoint(folder)
        args.model = str(folder)
    env = {**os.environ, "DISTVIDEO_NUM_THREADS": "1", "DISTVIDEO_NO_PROGRESS": "1"}
    figures: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for size in args.sizes.split(","):
            for layout in LAYOUTS:
                cmd = [sys.executable, __file__, f"--child={layout}:{size}", f"--model={args.model}"]
                out = subprocess.run(
                    [*cmd, f"--steps={args.steps}"], check=True, env=env, capture_output=True, text=True
                )
                rate = json.loads(out.stdout.strip().splitlines()[-1])["items_per_s"]
                figures.setdefault(size, {}).setdefault(layout, []).append(rate)
                print(
                    f"{size} {layout}: {rate:.3f} items/s (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True
                )
    lines = [f"8 prompts, {args.steps} steps, guidance 5, one thread per rank; medians of {args.rounds} rounds", ""]
    lines.append("| size | one rank (items/s) | replicas=2 | cfg=2 | replicas=2 / one rank | cfg=2 / one rank |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for size, by_layout in figures.items():
        med = {name: statistics.median(v) for name, v in by_layout.items()}
        lines.append(
            f"| {size} | {med['single']:.3f} | {med['replicas2']:.3f} | {med['cfg2']:.3f} | "
            f"{med['replicas2'] / med['single']:.2f}x | {med['cfg2'] / med['single']:.2f}x |"
        )
    resume = resume_seconds(args.resume_items)
    lines += ["", f"resume: {resume['items']} finished items, rerun returned in {resume['rerun_s']:.2f} s "
              f"(first run {resume['first_run_s']:.1f} s): {resume['rerun_output']}"]  # fmt: skip
    print("\n".join(lines))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"throughput": figures, "resume": resume}, indent=2) + "\n")


if __name__ == "__main__":
    main()
