"""What torchao costs a process that loads a model when diffusers and transformers import it (they do wherever it is
installed), against distvideo's `compat.defer_torchao()` (docs/performance.md, "Low precision"): CPU seconds (user +
system) of a fresh process that loads the tiny model's transformer, each way in turn, `--runs` times; medians.

    python benchmarks/torchao_import.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = """
import sys
if sys.argv[1] == "defer":
    from distvideo.models import compat
    compat.defer_torchao()
from diffusers import WanTransformer3DModel
from distvideo.models.embedded import tiny_model_path
WanTransformer3DModel.from_pretrained(str(tiny_model_path() / "transformer"))
print("torchao" in sys.modules)
"""


def cpu_seconds(mode: str) -> tuple[float, bool]:
    before = os.times()
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    after = os.times()
    used = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return used, out.stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    figures: dict[str, list[float]] = {"defer": [], "plain": []}
    for _ in range(runs):
        for mode in figures:
            used, imported = cpu_seconds(mode)
            figures[mode].append(used)
            print(f"{mode}: {used:.2f} CPU-s, torchao imported: {imported}")
    medians = {mode: statistics.median(values) for mode, values in figures.items()}
    print(
        f"medians: plain {medians['plain']:.2f}, deferred {medians['defer']:.2f} CPU-s; torchao costs "
        f"{medians['plain'] - medians['defer']:.2f} CPU-s per process"
    )


if __name__ == "__main__":
    main()
