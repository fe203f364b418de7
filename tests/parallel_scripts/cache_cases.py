"""Run by every rank under torchrun: cached requests on several layouts in one launch.

usage: cache_cases.py CASES_JSON OUT_DIR

CASES_JSON: {"model", "engines": [{"name", "sp_size", "cfg_parallel", "ring_size"}], "requests": {name: kwargs}}. Every rank
writes OUT_DIR/<engine>-<request>-rank<R>.json (its GenerationResult.cache); the output rank also saves the frames
as OUT_DIR/<engine>-<request>.npy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from distvideo import VideoGenerator


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for engine in cases["engines"]:
        with VideoGenerator.from_pretrained(
            cases["model"],
            executor="external",
            sp_size=engine["sp_size"],
            cfg_parallel=engine["cfg_parallel"],
            ring_size=engine["ring_size"],
        ) as gen:
            rank = dist.get_rank()
            for name, kwargs in cases["requests"].items():
                result = gen.generate("a red fox in the snow", save_video=False, **kwargs)
                stem = f"{engine['name']}-{name}"
                (out / f"{stem}-rank{rank}.json").write_text(json.dumps(result.cache))
                if result.frames is not None:
                    np.save(out / f"{stem}.npy", result.frames)


if __name__ == "__main__":
    main()
