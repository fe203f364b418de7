"""The automatic layout's estimates against measured runs on this machine (issue 33 asks for 25%).

For each mode (one rank; cfg 2; Ulysses 2; ring 2, each on the mp executor), one warm-up generation, then ``--runs``
timed ones; the measured figure is the median of the pipeline's ``per_step_denoising``. The table puts the cost
model's estimate for the same layout (parallel/autolayout.py, with the CPU figures of parallel/planner.py) beside
it, and compares the ratios to the single rank's, which is what the choice between layouts rests on (the absolute
figures are assumptions); the first of ``--modes`` is the reference of the ratios.

    python benchmarks/autolayout_check.py                           # the demo model, 64 x 64, 17 frames, 4 steps
    python benchmarks/autolayout_check.py --model PATH --height 192 --width 192 --num-frames 33 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from distvideo import VideoGenerator
from distvideo.models.embedded import embedded_model_path
from distvideo.models.registry import probe_model
from distvideo.parallel import planner
from distvideo.parallel.autolayout import Shape, estimate
from distvideo.request import GenerationRequest

MODES = {
    "single": (1, Shape(1, 1, 1, 1), {}),
    "cfg2": (2, Shape(1, 2, 1, 1), {"sp_size": 1, "cfg_parallel": True}),
    "ulysses2": (2, Shape(1, 1, 2, 1), {"sp_size": 2, "cfg_parallel": False, "ulysses_size": 2}),
    "ring2": (2, Shape(1, 1, 1, 2), {"sp_size": 2, "cfg_parallel": False, "ring_size": 2}),
}


def estimated(model_path: str, size: dict[str, int], world: int, shape: Shape) -> float:
    model = probe_model(model_path)
    request = GenerationRequest(prompt="x", guidance_scale=5.0, **size)
    figures = planner.model_figures(model, 4)
    wanted = planner.request_figures(model, request, 4)
    return estimate(figures, wanted, planner.device_figures("cpu", world), world, shape).time


def measured(model_path: str, size: dict[str, int], world: int, options: dict, steps: int, runs: int) -> float:
    executor = "inline" if world == 1 else "mp"
    with VideoGenerator.from_pretrained(model_path, num_gpus=world, executor=executor, **options) as gen:
        kwargs = dict(size, num_inference_steps=steps, guidance_scale=5.0, save_video=False, return_frames=False)
        gen.generate("a red ball moving right on a black background", **dict(kwargs, num_inference_steps=1))
        times = [gen.generate("a red ball moving right", **kwargs).timings["per_step_denoising"] for _ in range(runs)]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(embedded_model_path()))
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    size = {"height": args.height, "width": args.width, "num_frames": args.num_frames}
    rows = {}
    for mode in args.modes.split(","):
        world, shape, options = MODES[mode]
        start = time.perf_counter()
        rows[mode] = (
            estimated(args.model, size, world, shape),
            measured(args.model, size, world, options, args.steps, args.runs),
        )
        print(f"# {mode}: {time.perf_counter() - start:.1f} s", flush=True)
    base_est, base_meas = next(iter(rows.values()))  # the first mode is the reference
    print(f"{'mode':<10} {'est ms/step':>12} {'measured':>10} {'est ratio':>10} {'meas ratio':>11} {'ratio error':>12}")
    for mode, (est, meas) in rows.items():
        er, mr = est / base_est, meas / base_meas
        print(f"{mode:<10} {est * 1e3:>12.3g} {meas * 1e3:>10.3g} {er:>10.2f} {mr:>11.2f} {(er - mr) / mr:>+12.0%}")


if __name__ == "__main__":
    main()
