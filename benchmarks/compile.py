"""`--compile` against the same engine uncompiled, interleaved run by run in one process (so both sides see the same
machine load): the compiling first call, then medians of the warm runs, and the frames' max abs difference.

    nice -n 15 .venv/bin/python benchmarks/compile.py [--model DIR] [--shapes 9x48x64,17x128x128] [--steps 4] [--runs 5]

Prints one Markdown table row per shape (docs/performance.md, "Regional compilation").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from distvideo import VideoGenerator
from distvideo.config import EngineConfig
from distvideo.models.embedded import tiny_model_path

PROMPT = "a red fox running through snow"


def _run(gen: VideoGenerator, shape: tuple[int, int, int], steps: int) -> tuple[float, dict[str, float], np.ndarray]:
    frames, height, width = shape
    began = time.perf_counter()
    res = gen.generate(
        PROMPT, num_frames=frames, height=height, width=width, num_inference_steps=steps, seed=0, save_video=False
    )
    assert res.frames is not None
    return time.perf_counter() - began, res.timings, res.frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the tiny random-weight model)")
    parser.add_argument("--shapes", default="9x48x64,17x128x128", help="FRAMESxHEIGHTxWIDTH, comma separated")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5, help="warm runs of each side, interleaved")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    base = EngineConfig(
        model=args.model or str(tiny_model_path()), executor="inline", progress=False, log_level="WARNING"
    )
    eager = VideoGenerator.from_config(base)
    compiled = VideoGenerator.from_config(EngineConfig(**{**vars(base), "compile": True}))
    print(
        "| shape | first compiled call (s) | of which compile (s) | per step eager / compiled (s) | ratio "
        "| end to end eager / compiled (s) | frames max abs diff |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    try:
        for shape in shapes:
            _run(eager, shape, args.steps)  # warm-up of the eager side
            first_s, first, frames_c = _run(compiled, shape, args.steps)
            _, _, frames_e = _run(eager, shape, args.steps)
            runs: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
            for _ in range(args.runs):
                for name, gen in (("eager", eager), ("compiled", compiled)):
                    e2e, timings, _ = _run(gen, shape, args.steps)
                    runs[name].append((timings["per_step_denoising"], e2e))
            step = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
            e2e = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
            diff = int(np.abs(frames_c.astype(np.int16) - frames_e.astype(np.int16)).max())
            print(
                f"| {'x'.join(map(str, shape))} | {first_s:.2f} | {first.get('compile', 0.0):.2f} "
                f"| {step['eager']:.4f} / {step['compiled']:.4f} | {step['compiled'] / step['eager']:.2f} "
                f"| {e2e['eager']:.3f} / {e2e['compiled']:.3f} | {diff} |",
                flush=True,
            )
    finally:
        eager.shutdown()
        compiled.shutdown()


if __name__ == "__main__":
    main()
