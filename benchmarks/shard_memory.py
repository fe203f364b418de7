"""Memory per rank with sharded weights (`--shard-weights`), on a checkpoint whose weights dominate.

The checkpoint (`distvideo.testing.checkpoints.build_sharding_checkpoint`): an 8-layer, 1024-wide transformer and a
1024-wide text encoder with random weights. Each layout runs one warm-up generation and `--runs` timed ones on the mp
executor; per rank it reports:

- **resident weights**: the bytes of parameters and buffers the rank holds between steps (under FSDP its shards),
  counted from the modules; the figure the sharding promise is about (at most 0.3x one rank's with `all` on 4 ranks);
- **peak above loaded**: the rank's resident-set high-water mark (VmHWM, reset after a warm-up generation, once every
  weight page is resident) minus its resident set then, from /proc: on CPU what a generation adds (the gathered
  blocks under sharding, the activations, the decode);
- **denoising per step**: the median over the timed runs of `timings["denoising"] / steps`, and its ratio to the
  same layout unsharded (what sharding costs: the all-gathers of every block, every step).

    python benchmarks/shard_memory.py                     # one rank; cfg2 x sp2 and sp4, none vs transformer vs all
    python benchmarks/shard_memory.py --layouts sp4 --runs 3 --json shard.json

The figures are recorded in docs/BENCHMARKS.md with the command and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import cloudpickle

from distvideo import VideoGenerator
from distvideo.bench.measure import rank_weights_mb
from distvideo.testing.checkpoints import build_sharding_checkpoint

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LAYOUTS: dict[str, dict[str, Any]] = {
    "single": dict(executor="inline", num_gpus=1),
    "cfg2xsp2": dict(executor="mp", num_gpus=4, cfg_parallel=True, sp_size=2),
    "sp4": dict(executor="mp", num_gpus=4, cfg_parallel=False, sp_size=4),
}
REQUEST = dict(num_frames=9, height=64, width=64, num_inference_steps=4, guidance_scale=5.0, seed=0, save_video=False)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rank_memory(worker: Any, reset: bool = False) -> dict[str, float]:
    """This rank: resident weight bytes of every loaded component (`distvideo bench`'s figure), and its RSS and
    high-water mark, in MiB; with `reset`, the high-water mark then starts again from the present resident set
    (Linux's clear_refs 5)."""
    out = {
        "weights_mib": rank_weights_mb(worker),
        "hwm_mib": _status_kib("VmHWM") / 1024,
        "rss_mib": _status_kib("VmRSS") / 1024,
    }
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    return out


def run_layout(model: str, name: str, shard: str, runs: int) -> dict[str, Any]:
    layout = LAYOUTS[name]
    kwargs = dict(layout) if name == "single" else {**layout, "shard_weights": shard}
    with VideoGenerator.from_pretrained(model, **kwargs) as gen:
        # a warm-up generation first: it touches every weight (a weight file is mapped, its pages resident once read)
        gen.generate("a lighthouse in a storm", **{**REQUEST, "num_inference_steps": 1})
        start = gen.collective_rpc(rank_memory, (True,))  # the high-water mark starts again from here
        per_step = []
        for _ in range(runs):
            result = gen.generate("a lighthouse in a storm", **REQUEST)
            per_step.append(result.timings["denoising"] / REQUEST["num_inference_steps"])
        end = gen.collective_rpc(rank_memory)
    return {
        "layout": name,
        "shard_weights": shard if name != "single" else "none",
        "weights_mib": [round(r["weights_mib"], 1) for r in end],
        "peak_above_loaded_mib": [round(e["hwm_mib"] - s["rss_mib"], 1) for s, e in zip(start, end, strict=True)],
        "denoising_per_step_s": round(statistics.median(per_step), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="cfg2xsp2,sp4", help=f"comma-separated, of {','.join(LAYOUTS)}")
    parser.add_argument("--modes", default="none,transformer,all", help="--shard-weights values to compare")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--model", help="a checkpoint (default: build the sharding checkpoint in a temporary folder)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shard-memory-") as tmp:
        model = args.model or str(build_sharding_checkpoint(Path(tmp) / "ckpt"))
        rows = [run_layout(model, "single", "none", args.runs)]
        for name in args.layouts.split(","):
            for shard in args.modes.split(","):
                rows.append(run_layout(model, name, shard, args.runs))
    one = rows[0]["weights_mib"][0]
    unsharded = {r["layout"]: r["denoising_per_step_s"] for r in rows if r["shard_weights"] == "none"}
    print(f"load average {os.getloadavg()[0]:.2f}; one rank holds {one:.0f} MiB of weights")
    print(
        "| layout | shard | weights per rank (MiB, max) | x one rank | peak above loaded (MiB, max) | s/step | x unsharded |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        most = max(r["weights_mib"])
        ratio = r["denoising_per_step_s"] / unsharded.get(r["layout"], r["denoising_per_step_s"])
        print(
            f"| {r['layout']} | {r['shard_weights']} | {most:.0f} | {most / one:.2f} | {max(r['peak_above_loaded_mib']):.0f} "
            f"| {r['denoising_per_step_s']:.3f} | {ratio:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
