"""A whole `distvideo generate` command on each executor: wall time of the process, runs alternating executors.

What a user waits for, start to exit: imports, starting the ranks (for Ray, also starting and stopping a local
cluster when none is running), loading, generating and writing the video. Runs alternate between the executors
(mp, ray, mp, ray, ...) so drift in the machine hits both alike; the table shows each executor's median and its
difference from the first executor's median in the same invocation.

    python benchmarks/command_overhead.py --executors mp ray --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REQUEST = ["--prompt", "a red kite", "--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2"]


def run_once(executor: str, num_gpus: int, folder: Path, index: int) -> float:
    output = folder / f"{executor}-{index}.mp4"
    command = [sys.executable, "-m", "distvideo", "generate", "--executor", executor, "--num-gpus", str(num_gpus)]
    command += [*REQUEST, "--output", str(output), "--no-progress"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    elapsed = time.perf_counter() - start
    if done.returncode != 0 or not output.is_file():
        raise SystemExit(f"{executor} run {index} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executors", nargs="+", default=["mp", "ray"], choices=["mp", "ray"])
    parser.add_argument("--num-gpus", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    times: dict[str, list[float]] = {e: [] for e in args.executors}
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="command-overhead-") as tmp:
        for index in range(args.runs):
            for executor in args.executors:
                times[executor].append(run_once(executor, args.num_gpus, Path(tmp), index))
                print(f"# {executor} run {index}: {times[executor][-1]:.2f} s", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}\n")
    reference = statistics.median(times[args.executors[0]])
    print("| executor | runs (s) | median (s) | over " + args.executors[0] + " (s) | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for executor, values in times.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {executor} | {runs} | {median:.2f} | {median - reference:+.2f} | {median / reference:.2f}x |")


if __name__ == "__main__":
    main()
