"""`distvideo plan --model M --num-gpus N [--nodes K] [--height H --width W --num-frames F]`: the layout the engine
would choose (parallel/autolayout.py's cost model), the alternatives with their estimated time per step and memory
per rank, and why. Reads the checkpoint's JSON files and weight headers only; never imports torch or loads a weight.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from distvideo import envs
from distvideo.config import QUANTIZE_MODES
from distvideo.errors import ConfigError

OBJECTIVES = ("latency", "throughput")


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="the parallel layout the engine would choose for a model and request, and why")
    p.add_argument("--model", help="checkpoint folder or repo id (default: DISTVIDEO_MODEL, else the demo model)")
    p.add_argument("--num-gpus", dest="num_gpus", type=int, required=True, help="ranks in all (world size)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over, evenly (default 1)")
    p.add_argument("--height", type=int, help="pixels (default: the model's)")
    p.add_argument("--width", type=int, help="pixels (default: the model's)")
    p.add_argument("--num-frames", dest="num_frames", type=int, help="frames (default: the model's)")
    p.add_argument("--guidance-scale", dest="guidance_scale", type=float, help="CFG scale (default: the model's)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device kind (default: cuda when a GPU is present)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: bfloat16 on cuda")
    p.add_argument("--memory-gib", dest="memory_gib", type=float, help="memory per rank (default: the device's)")
    p.add_argument("--quantize", choices=QUANTIZE_MODES, help="the transformers' weights in 8 bits (as generate)")
    p.add_argument(
        "--quantize-text-encoder", dest="quantize_text_encoder", choices=QUANTIZE_MODES, help="the text encoders'"
    )
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="latency",
        help="latency: one request as fast as possible (the engine's choice); throughput: requests per second with "
        "every replica busy (batches, services)",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="measure this machine's CPU figures first (matmul rate, per-layer cost, gloo all-to-all latency and "
        "bandwidth per group size; a few seconds) and keep them for every later plan and automatic layout here "
        "(DISTVIDEO_PROBE_FILE)",
    )
    p.add_argument("--top", type=int, default=12, help="alternatives shown (default 12)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _check(args: argparse.Namespace) -> None:
    """Bad numbers named before the checkpoint is read."""
    if args.num_gpus < 1:
        raise ConfigError(f"--num-gpus {args.num_gpus}: must be >= 1 (the number of ranks)")
    if args.nodes < 1 or args.num_gpus % args.nodes:
        raise ConfigError(
            f"--nodes {args.nodes}: must be >= 1 and divide --num-gpus {args.num_gpus} (the same number of ranks on "
            "every node)"
        )
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise ConfigError(f"--memory-gib {args.memory_gib}: must be a positive number of GiB per rank")
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: must be >= 1")
    if args.probe and args.device == "cuda":
        raise ConfigError(
            "--probe with --device cuda: the probe measures this machine's CPU ranks; the CUDA figures are the "
            "documented assumptions (docs/parallel.md), checked by benchmarks/gpu_check.py's layout_estimate phase"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    from distvideo.config import Naming
    from distvideo.models.embedded import embedded_model_path
    from distvideo.models.hub import resolve_model
    from distvideo.models.registry import probe_model
    from distvideo.parallel.planner import default_request, device_figures, device_kind, plan_for

    _check(args)
    name = args.model or envs.get("DISTVIDEO_MODEL")
    model = probe_model(resolve_model(name) if name else embedded_model_path())
    sizes = {k: getattr(args, k) for k in ("height", "width", "num_frames", "guidance_scale")}
    request = default_request(model, Naming("flag"), **sizes)  # as generate resolves it
    memory = int(args.memory_gib * 2**30) if args.memory_gib else None
    if args.probe and device_kind(args.device) == "cpu":  # measured and kept, then planned with the measured figures
        from distvideo.parallel.probe import measure

        measure()
    plan = plan_for(
        model,
        request,
        args.num_gpus,
        ranks_per_node=args.num_gpus // args.nodes,
        device=args.device,
        dtype=args.dtype,
        memory_bytes=memory,
        objective=args.objective,
        quantize=args.quantize,
        quantize_text_encoder=args.quantize_text_encoder,
        can_shard=all(mode in (None, "none") for mode in (args.quantize, args.quantize_text_encoder)),
    )
    kind = device_kind(args.device)
    hardware = device_figures(kind, args.num_gpus // args.nodes, memory)
    header = {
        "model": str(model.path),
        "family": model.family.name,
        "request": {k: getattr(request, k) for k in ("num_frames", "height", "width", "guidance_scale")},
        "world": args.num_gpus,
        "nodes": args.nodes,
        "hardware": dataclasses.asdict(hardware),
        "hardware_note": hardware_note(kind, args.device, args.nodes),
        "columns": COLUMNS,
    }
    if args.json:
        print(json.dumps(plan_json(plan, header), indent=2))
    else:
        print(plan_text(plan, header, args.top))
    return 0


#: what each figure of a row is (the JSON's rows and the table's columns)
COLUMNS = {
    "time_per_step_s": "one request's denoising step, on the ranks of one replica (both CFG branches)",
    "steps_per_second": "denoising steps per second over all replicas, every replica busy with a request of its own",
    "memory_per_rank_bytes": "on the busiest rank (the output rank): weights, working set, video",
    "eligible": "whether the objective may choose it (latency: one request on every rank, so no replicas)",
}


def hardware_note(kind: str, device: str | None, nodes: int) -> str:
    """Where the device figures came from, and how to ask for others."""
    if device is None:
        found = "a GPU found on this machine" if kind == "cuda" else "no GPU found on this machine"
        other = "--device cpu" if kind == "cuda" else "--device cuda"
        note = f"{kind} figures because {found}; {other} plans for the other kind"
    else:
        note = f"{kind} figures (--device {device})"
    if kind == "cpu" and nodes > 1:
        note += "; the CPU figures assume the same link inside and across nodes, so --nodes changes no CPU estimate"
    return note


def figure_source(hardware: dict[str, Any]) -> str:
    if hardware["source"] != "probed":
        return "assumed, docs/parallel.md; `distvideo plan --probe` measures this machine's"
    from distvideo.parallel.probe import cached_probe, probe_path

    probed = cached_probe()
    return f"measured {probed.measured if probed else ''} by --probe, {probe_path()}"


def flags(shape: Any) -> str:
    """The explicit flags that give the same layout."""
    cfg = "--cfg-parallel" if shape.cfg == 2 else "--no-cfg-parallel"
    return (
        f"--replicas {shape.replicas} {cfg} --ulysses-size {shape.ulysses} --ring-size {shape.ring} "
        f"--shard-weights {shape.shard}"
    )


def milliseconds(seconds: float) -> str:
    """A time per step in ms as a person reads it: 12.2, 480 or 46,380 (no exponent)."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def per_second(rate: float) -> str:
    """A rate as a person reads it: 0.52, 81.9 or 19,900 (no exponent)."""
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def plan_json(plan: Any, header: dict[str, Any]) -> dict[str, Any]:
    def row(c: Any) -> dict[str, Any]:
        return {
            **dataclasses.asdict(c.shape),
            "sp": c.shape.sp,
            "time_per_step_s": c.time,
            "steps_per_second": c.requests_per_second,
            "memory_per_rank_bytes": c.memory,
            "feasible": c.feasible,
            "eligible": eligible(c, plan.objective),
            "why": c.why,
            "parts_s": c.parts,
        }

    return {
        **header,
        "objective": plan.objective,
        "chosen": row(plan.chosen),
        "flags": flags(plan.chosen.shape),
        "reasons": plan.reasons,
        "candidates": [row(c) for c in plan.candidates],
    }


def eligible(c: Any, objective: str) -> bool:
    """Whether the objective may choose the row: latency runs one request on every rank (no replicas)."""
    return bool(c.feasible) and (objective != "latency" or c.shape.replicas == 1)


def plan_text(plan: Any, header: dict[str, Any], top: int) -> str:
    from distvideo.parallel.autolayout import gib

    c, hw, req = plan.chosen, header["hardware"], header["request"]
    lines = [
        f"model: {header['model']} ({header['family']})",
        f"request: {req['num_frames']} frames x {req['height']} x {req['width']}, guidance {req['guidance_scale']}",
        f"world: {header['world']} ranks on {header['nodes']} node(s); {hw['kind']} figures ({figure_source(hw)}): "
        f"{hw['flops'] / 1e12:.3g} TFLOP/s, {gib(hw['memory_bytes'])} per rank, links "
        f"{hw['intra_bandwidth'] / 1e9:.3g} / {hw['inter_bandwidth'] / 1e9:.3g} GB/s inside / across nodes",
        f"device figures: {header['hardware_note']}",
        "",
        f"chosen ({plan.objective}): {c.shape.describe()}: est. {milliseconds(c.time)} ms/step, {gib(c.memory)} per rank",
        f"  as flags: {flags(c.shape)}",
        "",
        "ms/step: one request's denoising step on one replica's ranks; steps/s: all replicas busy, each with its own "
        "request; memory: the busiest rank",
        f"{'layout':<52} {'ms/step':>10} {'steps/s':>9} {'memory/rank':>12}  {'feasible':<8}  why",
    ]
    # a sharded variant of a layout that fits unsharded is never chosen: left out of the table (not of --json)
    fits = {
        (x.shape.replicas, x.shape.cfg, x.shape.ulysses) for x in plan.candidates if x.shape.shard == "none" and x.fits
    }
    listed = [
        x
        for x in plan.candidates
        if x.shape.shard == "none" or (x.shape.replicas, x.shape.cfg, x.shape.ulysses) not in fits
    ]
    # the chosen first, then what the objective may choose (by time), then what it may not
    others = sorted((x for x in listed if x is not c), key=lambda x: not eligible(x, plan.objective))
    shown = [c, *others[: top - 1]]
    for x in shown:
        lines.append(
            f"{'*' if x is c else ' '}{x.shape.describe():<51} {milliseconds(x.time):>10} "
            f"{per_second(x.requests_per_second):>9} {gib(x.memory):>12}  {'yes' if x.feasible else 'no':<8}  "
            f"{_why(x, c, plan.objective)}"
        )
    if len(listed) > len(shown):
        lines.append(f"  ... {len(listed) - len(shown)} more (--top N); --json lists all, sharded variants included")
    lines += ["", "why:", *(f"  - {r}" for r in plan.reasons)]
    return "\n".join(lines)


def _why(x: Any, chosen: Any, objective: str) -> str:
    if x is chosen:
        return "chosen"
    if x.why:
        return str(x.why)
    ratios = f"{x.time / chosen.time:.2f}x the chosen's step time, {x.requests_per_second / chosen.requests_per_second:.2f}x its steps/s"
    if not eligible(x, objective):
        return f"not for latency: replicas run separate requests; {ratios} (--objective throughput)"
    return ratios
