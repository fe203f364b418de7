"""Control-plane latency: a no-op `collective_rpc("ping")` on the mp and external executors.

For each world size, the mp executor is driven from this process; the external executor runs this same
script under torchrun (one process per rank, `--external-rank`), where every rank pings and rank 0 reports.
Each configuration makes `--repeats` runs of `--calls` pings after a warm-up; the table shows the median
over runs of each run's median and p99, and the external/mp ratio measured in the same invocation.

    python benchmarks/control_plane.py                       # world sizes 1, 2, 4; mp and external
    python benchmarks/control_plane.py --world-sizes 2 --executors mp --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULT_PREFIX = "CONTROL_PLANE_RESULT "


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def time_pings(gen: Any, calls: int, repeats: int, warmup: int) -> list[dict[str, float]]:
    """`repeats` runs of `calls` pings; per run: median and p99 in milliseconds."""
    for _ in range(warmup):
        gen.collective_rpc("ping")
    runs = []
    for _ in range(repeats):
        latencies = []
        for _ in range(calls):
            start = time.perf_counter()
            gen.collective_rpc("ping")
            latencies.append((time.perf_counter() - start) * 1e3)
        latencies.sort()
        runs.append({"median_ms": statistics.median(latencies), "p99_ms": percentile(latencies, 0.99)})
    return runs


def summarise(executor: str, world: int, runs: list[dict[str, float]], calls: int) -> dict[str, Any]:
    return {
        "executor": executor,
        "world_size": world,
        "calls_per_run": calls,
        "runs": runs,
        "median_ms": statistics.median(r["median_ms"] for r in runs),
        "p99_ms": statistics.median(r["p99_ms"] for r in runs),
    }


def bench_mp(model: str, world: int, args: argparse.Namespace, executor: str = "mp") -> dict[str, Any]:
    """A driver-side executor (mp, or ray: a running Ray cluster, else a local one) driven from this process."""
    from distvideo import VideoGenerator

    with VideoGenerator.from_pretrained(model, num_gpus=world, executor=executor) as gen:
        runs = time_pings(gen, args.calls, args.repeats, args.warmup)
    return summarise(executor, world, runs, args.calls)


def torchrun_command(model: str, world: int, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",  # = torchrun
        "--standalone",
        f"--nproc-per-node={world}",
        str(Path(__file__).resolve()),
        "--external-rank",
        f"--model={model}",
        f"--calls={args.calls}",
        f"--repeats={args.repeats}",
        f"--warmup={args.warmup}",
    ]


def bench_external(model: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = torchrun_command(model, world, args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.launch_timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(
            f"torchrun failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    runs = json.loads(lines[-1][len(RESULT_PREFIX) :])
    return summarise("external", world, runs, args.calls)


def external_rank(args: argparse.Namespace) -> None:
    """One rank under torchrun: every rank pings in lockstep; rank 0 prints the timings."""
    from distvideo import VideoGenerator

    with VideoGenerator.from_pretrained(args.model, executor="external") as gen:
        runs = time_pings(gen, args.calls, args.repeats, args.warmup)
        if gen.is_output_rank:
            print(RESULT_PREFIX + json.dumps(runs), flush=True)


def resolve_model(model: str | None, scratch: Path) -> str:
    if model:
        return model
    from distvideo.models.embedded import tiny_model_path
    from distvideo.testing.checkpoints import build_embedded_model

    try:
        return str(tiny_model_path())
    except FileNotFoundError:
        return str(build_embedded_model(scratch / "tiny-wan"))


def machine() -> dict[str, Any]:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": cores,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    mp_median = {r["world_size"]: r["median_ms"] for r in rows if r["executor"] == "mp"}
    out = [
        "| executor | world size | median (ms) | p99 (ms) | median vs mp |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["world_size"], r["executor"] != "mp")):
        ref = mp_median.get(r["world_size"])
        ratio = f"{r['median_ms'] / ref:.1f}x" if ref else "-"
        out.append(f"| {r['executor']} | {r['world_size']} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--executors", nargs="+", choices=["mp", "external", "ray"], default=["mp", "external"])
    parser.add_argument("--calls", type=int, default=1000, help="pings per run (default 1000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (default 3)")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny model)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--launch-timeout", type=float, default=600.0)
    parser.add_argument("--external-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("DISTVIDEO_LOG_LEVEL", "WARNING")
    if args.external_rank:
        external_rank(args)
        return

    with tempfile.TemporaryDirectory(prefix="distvideo-bench-") as scratch:
        model = resolve_model(args.model, Path(scratch))
        info = machine()
        print(f"# machine: {info}", flush=True)
        rows = []
        for world in args.world_sizes:
            for executor in args.executors:
                if executor == "external":
                    row = bench_external(model, world, args)
                else:
                    row = bench_mp(model, world, args, executor)
                print(f"# {executor} world {world}: median {row['median_ms']:.3f} ms, p99 {row['p99_ms']:.3f} ms")
                rows.append(row)
        info["loadavg_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print()
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "command": sys.argv, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
