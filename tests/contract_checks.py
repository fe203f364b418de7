"""What every executor must do the same way, observed on a live VideoGenerator.

`observe(gen, threads_before)` runs the contract's calls and returns plain data; the contract tests run it in
process (inline, mp) and on every rank under torchrun (external), then assert the same things of each.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

REQUEST = dict(num_frames=5, height=32, width=48, num_inference_steps=2, seed=9, save_video=False)
PROMPT = "a paper boat on a pond"


def fail_on_last_rank(worker):
    if worker.rank == worker.world_size - 1:
        raise ValueError(f"planted failure on rank {worker.rank}")
    return worker.rank


def describe(worker):
    return {"rank": worker.rank, "world_size": worker.world_size, "pid": os.getpid(), "device": str(worker.device)}


def expected_failure_text(world_size: int) -> str:
    last = world_size - 1
    return (
        f"collective_rpc('fail_on_last_rank') failed on 1 of {world_size} rank(s):\n"
        f"  rank {last}: ValueError: planted failure on rank {last}"
    )


def thread_ids() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def observe(gen, threads_before: set[int]) -> tuple[dict[str, Any], np.ndarray | None]:
    """`threads_before`: the ids of this process's threads before the generator was created (`thread_ids()`)."""
    import torch.distributed as dist

    obs: dict[str, Any] = {"world_size": gen.world_size, "is_output_rank": gen.is_output_rank}
    obs["describe"] = gen.collective_rpc(describe)
    obs["ping"] = gen.collective_rpc("ping")
    obs["last_rank_only"] = gen.collective_rpc("ping", unique_reply_rank=gen.world_size - 1)
    obs["kwargs"] = gen.collective_rpc(lambda w, a, b=0: a + b + w.rank, args=(10,), kwargs={"b": 5})
    try:
        gen.collective_rpc(fail_on_last_rank)
        obs["failure"] = None
    except RuntimeError as exc:
        obs["failure"] = str(exc)
    obs["ping_after_failure"] = gen.collective_rpc("ping")
    res = gen.generate(PROMPT, **REQUEST)
    obs["video_path"] = res.video_path
    frames = res.frames
    obs["has_frames"] = frames is not None
    gen.shutdown()
    gen.shutdown()  # idempotent
    try:
        gen.collective_rpc("ping")
        obs["after_shutdown"] = None
    except RuntimeError as exc:
        obs["after_shutdown"] = str(exc)
    # what shutdown must leave behind in this process: no thread of the executor's, no process group (tqdm's monitor
    # thread, started by the first progress bar, belongs to tqdm and lives as long as the process; the suite's
    # background jobs, tests/background.py, start and end threads of their own meanwhile)
    obs["threads_left"] = sorted(
        t.name
        for t in threading.enumerate()
        if t.ident not in threads_before and t.name != "tqdm_monitor" and not t.name.startswith("background-")
    )
    obs["process_group_left"] = dist.is_available() and dist.is_initialized()
    return obs, frames
