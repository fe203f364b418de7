"""Run by every rank of a 2-rank torchrun launch: a FastWan-style checkpoint (3 declared steps, no guidance) on the
layout the engine picks for it (one branch: cfg 1 x sp 2), then as two replicas; and the tiny model with a
LightX2V-named step-distill LoRA at sp 2 and as two replicas with that LoRA's schedule (tests/test_schedules.py compares each with
diffusers). Each rank builds the checkpoint into a folder of its own (the builder is deterministic: the
same bytes as the test's), here rather than in the test's background thread, where diffusers' loading in the main
thread would put the new modules on the meta device.

usage: few_step_ranks.py OUT_DIR

The output rank writes OUT_DIR/{sp,replicas,lora,lora-replicas}.npy and OUT_DIR/layouts.json (each engine's layout).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from distvideo import VideoGenerator
from distvideo.models.embedded import tiny_model_path
from distvideo.testing.distilled import LIGHTX2V_STEP_DISTILL, build_fastwan_style, build_step_distill_lora

PROMPT = "a red fox running through snow"
LORA_REQUEST = dict(num_frames=5, height=32, width=48, seed=4, **LIGHTX2V_STEP_DISTILL)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rank = os.environ["RANK"]
    model = build_fastwan_style(out / f"fastwan-rank{rank}")
    # the adapter's name comes from the file's: the same name in a folder per rank
    lora = build_step_distill_lora(tiny_model_path(), out / f"rank{rank}" / "lightx2v.safetensors")
    layouts = {}
    runs = [
        ("sp", model, {}, {"seed": 7}),
        ("replicas", model, {"replicas": 2}, {"seed": 7}),
        ("lora", tiny_model_path(), {"sp_size": 2, "lora": [str(lora)]}, LORA_REQUEST),
        ("lora-replicas", tiny_model_path(), {"replicas": 2, "lora": [str(lora)]}, LORA_REQUEST),
    ]
    for name, path, engine, request in runs:
        with VideoGenerator.from_pretrained(path, num_gpus=2, progress=False, **engine) as gen:
            result = gen.generate(PROMPT, save_video=False, **request)
            layouts[name] = gen.engine.layout.describe()
            if gen.is_output_rank:
                np.save(out / f"{name}.npy", result.frames)
    if layouts and (out / "sp.npy").exists():
        (out / "layouts.json").write_text(json.dumps(layouts))


if __name__ == "__main__":
    main()
