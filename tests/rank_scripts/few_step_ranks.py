"""Run by every rank of a 2-rank torchrun launch: a FastWan-style checkpoint (3 declared steps, no guidance) on the
layout the engine picks for it (one branch: cfg 1 x sp 2), then as two replicas (tests/test_schedules.py compares
both with diffusers). Each rank builds the checkpoint into a folder of its own (the builder is deterministic: the
same bytes as the test's), here rather than in the test's background thread, where diffusers' loading in the main
thread would put the new modules on the meta device.

usage: few_step_ranks.py OUT_DIR

The output rank writes OUT_DIR/sp.npy and OUT_DIR/replicas.npy, and OUT_DIR/layouts.json (each engine's layout).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from distvideo import VideoGenerator
from distvideo.testing.distilled import build_fastwan_style

PROMPT = "a red fox running through snow"


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model = build_fastwan_style(out / f"fastwan-rank{os.environ['RANK']}")
    layouts = {}
    for name, layout in (("sp", {}), ("replicas", {"replicas": 2})):
        with VideoGenerator.from_pretrained(model, num_gpus=2, progress=False, **layout) as gen:
            result = gen.generate(PROMPT, seed=7, save_video=False)
            layouts[name] = gen.engine.layout.describe()
            if gen.is_output_rank:
                np.save(out / f"{name}.npy", result.frames)
    if layouts and (out / "sp.npy").exists():
        (out / "layouts.json").write_text(json.dumps(layouts))


if __name__ == "__main__":
    main()
