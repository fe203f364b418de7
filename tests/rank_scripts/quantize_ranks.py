"""Run by every rank of a 2-rank torchrun launch: the tiny model with int8 weights and activations at sp=2 on the
external executor (tests/test_quantize.py compares the frames with mp's at the same layout, byte for byte).

usage: quantize_ranks.py OUT_DIR

Rank 0 writes OUT_DIR/frames.npy; every rank writes OUT_DIR/weights<RANK>.json (its weight report).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from distvideo import VideoGenerator
from distvideo.models.embedded import tiny_model_path

SP2 = dict(num_gpus=2, sp_size=2, cfg_parallel=False)  # sequence parallelism over the quantized layers
REQUEST = dict(num_frames=5, height=32, width=48, num_inference_steps=2, seed=0, guidance_scale=5.0, save_video=False)
PROMPT = "a red ball moving right on a black background"


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    with VideoGenerator.from_pretrained(tiny_model_path(), quantize="int8", progress=False, **SP2) as gen:
        result = gen.generate(PROMPT, **REQUEST)
        rank = gen.collective_rpc(lambda worker: worker.rank)
        weights = gen.collective_rpc(lambda worker: worker.weights)
        output_rank = gen.is_output_rank
    if output_rank:
        np.save(out / "frames.npy", result.frames)
    for r, report in zip(rank, weights, strict=True):
        (out / f"weights{r}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
