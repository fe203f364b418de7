"""The automatic layout's estimates against measured runs on this machine (issue 50 asks for 25%).

First the probe measures this machine's figures (parallel/probe.py: a transformer layer's FLOP rate and fixed cost
per thread count, gloo all-to-all latency and bandwidth per group size), as `distvideo plan --probe` does; then each
mode (one rank, inline; cfg 2; Ulysses 2; ring 2, each on the mp executor) gets a generator, a warm-up generation,
and ``--rounds`` timed ones, interleaved (every mode once per round, so a slow spell of the machine falls on all of
them). The measured figure is the median of the pipeline's ``per_step_denoising``; beside it the cost model's estimate
for the same layout with the probed figures (parallel/autolayout.py's ``estimate``), its error, and both as ratios to
the first mode's.

``--record PATH`` writes the probe's figures, the request, and every mode's runs and median as JSON: the file
``tests/test_autolayout_probe.py`` reads to check that the estimate from those figures orders the layouts as measured.

    python benchmarks/autolayout_check.py                                   # the benchmark checkpoint, 128 x 128
    python benchmarks/autolayout_check.py --rounds 7 --record benchmarks/records/autolayout_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from distvideo import GenerationRequest, VideoGenerator
from distvideo.models.registry import probe_model
from distvideo.parallel import planner
from distvideo.parallel.autolayout import Shape, estimate
from distvideo.parallel.probe import cached_probe, measure

MODES = {
    "single": (1, Shape(1, 1, 1, 1), {}),
    "cfg2": (2, Shape(1, 2, 1, 1), {"sp_size": 1, "cfg_parallel": True}),
    "ulysses2": (2, Shape(1, 1, 2, 1), {"sp_size": 2, "cfg_parallel": False, "ulysses_size": 2}),
    "ring2": (2, Shape(1, 1, 1, 2), {"sp_size": 2, "cfg_parallel": False, "ring_size": 2}),
}
PROMPT = "a red ball moving right on a black background"


def estimated(model_path: str, size: dict[str, int], world: int, shape: Shape) -> tuple[float, dict[str, Any]]:
    """The cost model's seconds per step for the layout, with this machine's probed figures (float32 weights), and
    its inputs (the record's)."""
    model = probe_model(model_path)
    request = model.resolve_request(GenerationRequest(prompt=PROMPT, guidance_scale=5.0, **size), read_image=False)
    figures = planner.model_figures(model, 4)
    wanted = planner.request_figures(model, request, 4)
    hardware = planner.device_figures("cpu", world)
    assert hardware.source == "probed", "the probe's figures are read back"
    inputs = {"model_figures": asdict(figures), "request_figures": asdict(wanted), "hardware": asdict(hardware)}
    return estimate(figures, wanted, hardware, world, shape).time, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint (default: the benchmark checkpoint, built in a temporary folder)")
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--record", help="write the probe, the runs and the medians as JSON to this file")
    args = parser.parse_args()
    print(f"# load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        model = args.model
        if model is None:
            from distvideo.testing.checkpoints import build_benchmark_checkpoint

            model = str(build_benchmark_checkpoint(Path(folder) / "bench-ckpt"))
        start = time.perf_counter()
        measure()
        probe = cached_probe()
        assert probe is not None
        print(f"# probe: {time.perf_counter() - start:.1f} s: {json.dumps(probe.to_json())}", flush=True)
        size = {"height": args.height, "width": args.width, "num_frames": args.num_frames}
        modes = args.modes.split(",")
        runs = run_interleaved(model, size, modes, args.steps, args.rounds)
        inputs = {mode: estimated(model, size, *MODES[mode][:2]) for mode in modes}
        rows = {mode: (inputs[mode][0], statistics.median(runs[mode])) for mode in modes}
    print_table(rows)
    if args.record:
        record = {
            "command": "python benchmarks/autolayout_check.py "
            + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "record"
            ),
            "load_average_at_start": os.getloadavg(),
            "probe": probe.to_json(),
            "model_figures": inputs[modes[0]][1]["model_figures"],
            "request_figures": inputs[modes[0]][1]["request_figures"],
            "hardware": {mode: inputs[mode][1]["hardware"] for mode in modes},
            "request": {**size, "num_inference_steps": args.steps, "guidance_scale": 5.0},
            "runs_s": runs,
            "median_s": {mode: rows[mode][1] for mode in modes},
            "estimate_s": {mode: rows[mode][0] for mode in modes},
        }
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(record, indent=1) + "\n")


def run_interleaved(model: str, size: dict[str, int], modes: list[str], steps: int, rounds: int) -> dict:
    """Every mode's ``per_step_denoising`` in each round, the modes in turn within a round."""
    kwargs = dict(size, num_inference_steps=steps, guidance_scale=5.0, save_video=False, return_frames=False)
    generators = {}
    try:
        for mode in modes:
            world, _, options = MODES[mode]
            executor = "inline" if world == 1 else "mp"
            generators[mode] = VideoGenerator.from_pretrained(model, num_gpus=world, executor=executor, **options)
            generators[mode].generate(PROMPT, **dict(kwargs, num_inference_steps=1))  # warm-up
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        for n in range(rounds):
            for mode in modes:
                runs[mode].append(generators[mode].generate(PROMPT, **kwargs).timings["per_step_denoising"])
            print(f"# round {n + 1}: " + ", ".join(f"{m} {runs[m][-1] * 1e3:.1f} ms" for m in modes), flush=True)
        return runs
    finally:
        for gen in generators.values():
            gen.shutdown()


def print_table(rows: dict[str, tuple[float, float]]) -> None:
    base_est, base_meas = next(iter(rows.values()))  # the first mode is the reference of the ratios
    print(f"{'mode':<10} {'est ms/step':>12} {'median':>10} {'error':>8} {'est ratio':>10} {'meas ratio':>11}")
    for mode, (est, meas) in rows.items():
        print(
            f"{mode:<10} {est * 1e3:>12.3g} {meas * 1e3:>10.3g} {(est - meas) / meas:>+8.0%} "
            f"{est / base_est:>10.2f} {meas / base_meas:>11.2f}"
        )


if __name__ == "__main__":
    main()
