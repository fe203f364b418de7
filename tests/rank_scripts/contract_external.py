"""Every rank under torchrun: observe the executor contract and write rank<N>.json (+ frames.npy on rank 0)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from distvideo import VideoGenerator

from contract_checks import observe, thread_ids

out = Path(sys.argv[1])
before = thread_ids()
gen = VideoGenerator.from_pretrained(executor="external")
rank = gen.executor.rank
obs, frames = observe(gen, before)
if frames is not None:
    np.save(out / "frames.npy", frames)
(out / f"rank{rank}.json").write_text(json.dumps(obs))
