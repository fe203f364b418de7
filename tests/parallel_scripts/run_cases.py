"""Run by every rank under torchrun: several parallel layouts and requests in one launch.

usage: run_cases.py CASES_JSON OUT_DIR

CASES_JSON holds a list of engines, each {"name", "model", "sp_size", "cfg_parallel", "requests": [{"name",
"kwargs"}]} and optionally "ulysses_size" and "ring_size" (USP). A request's "kwargs" go to generate() as they are
(negative_prompt among them); its "prompt" is PROMPT unless they name one. Every engine is a VideoGenerator on the
external executor (all alive at once, so one launch serves them all). Rank 0 saves each request's frames as
OUT_DIR/<engine>-<request>.npy and writes OUT_DIR/report.json with the collectives counted per request: real calls of
torch.distributed.all_to_all_single (patched here) and the plans' own counters. An engine may also ask for
"decode_checks": latent shapes decoded with the banded decoder and on one rank, whose float difference goes into the
report; and for "tiling_checks": latent shapes decoded with diffusers' tiled decode enabled (small tiles, so it
tiles), where the banded decoder must fall back to rank 0 alone: the float difference from a plain tiled decode, the
halo exchanges and gathers made, per rank.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distvideo import VideoGenerator

PROMPT = "a red fox running through snow"
REAL_CALLS: Counter[str] = Counter()
_all_to_all_single = dist.all_to_all_single


def _counting_all_to_all_single(*args: Any, **kwargs: Any) -> Any:
    REAL_CALLS["all_to_all_single"] += 1
    return _all_to_all_single(*args, **kwargs)


dist.all_to_all_single = _counting_all_to_all_single


def plan_counts(worker: Any) -> dict[str, Any]:
    p = worker.parallel
    return {
        "context": dict(p.counts),
        "ulysses": dict(p.ulysses.counts) if p.ulysses is not None else {},
        "vae": dict(p.vae_decoder.counts),
        "ring": dict(p.ulysses.ring.counts) if p.ulysses is not None and p.ulysses.ring is not None else {},
        "layout": [p.layout.world_size, p.layout.cfg_degree, p.layout.sp_size],
        "usp": [p.layout.ulysses_size, p.layout.ring_size],
    }


def reset_counts(worker: Any) -> None:
    p = worker.parallel
    for counter in (p.counts, p.vae_decoder.counts, *([p.ulysses.counts] if p.ulysses is not None else [])):
        counter.clear()
    if p.ulysses is not None and p.ulysses.ring is not None:
        p.ulysses.ring.counts.clear()


def decode_check(worker: Any, shape: list[int], seed: int) -> float | None:
    """Max abs float difference between the banded decode and a single-rank decode of the same latents (rank 0)."""
    latents = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed)).to(worker.device)
    with torch.no_grad():
        banded = worker.parallel.decode(latents)
        if banded is None:
            return None
        single = worker.pipeline.vae.decode(latents, return_dict=False)[0]
    assert banded.shape == single.shape, (banded.shape, single.shape)
    return float((banded - single).abs().max())


def tiling_check(worker: Any, shape: list[int], seed: int) -> tuple[float | None, int, int]:
    """(max abs difference between the parallel decode and a one-rank tiled decode on rank 0, or None elsewhere; halo
    exchanges; gathers) with tiling on; tiling is switched off again afterwards."""
    vae = worker.pipeline.vae
    latents = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed)).to(worker.device)
    vae.enable_tiling(
        tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16, tile_sample_stride_width=16
    )
    counts = worker.parallel.vae_decoder.counts
    counts.clear()
    try:
        with torch.no_grad():
            parallel = worker.parallel.decode(latents)
            made = (counts.get("halo_exchange", 0), counts.get("gather", 0))
            if parallel is None:
                return None, *made
            single = vae.decode(latents, return_dict=False)[0]
    finally:
        vae.disable_tiling()
    untiled = vae.decode(latents, return_dict=False)[0]
    assert not torch.equal(untiled, single), "the tiles were too large to tile: the check would prove nothing"
    return float((parallel - single).abs().max()), *made


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    report: dict[str, Any] = {}
    with ExitStack() as stack:  # the first generator owns the process group: it is shut down last
        for case in cases:
            gen = stack.enter_context(
                VideoGenerator.from_pretrained(
                    case["model"],
                    executor="external",
                    sp_size=case["sp_size"],
                    cfg_parallel=case["cfg_parallel"],
                    ulysses_size=case.get("ulysses_size"),
                    ring_size=case.get("ring_size"),
                )
            )
            for request in case["requests"]:
                key = f"{case['name']}-{request['name']}"
                gen.collective_rpc(reset_counts)
                REAL_CALLS.clear()
                res = gen.generate(save_video=False, **{"prompt": PROMPT, **request["kwargs"]})
                counts = gen.collective_rpc(plan_counts)
                per_rank: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, (dict(REAL_CALLS), res.frames is not None))
                report[key] = {
                    "plan_counts": counts,
                    "real_calls": [calls for calls, _ in per_rank],
                    "has_frames": [has for _, has in per_rank],
                }
                if gen.is_output_rank:
                    np.save(out / f"{key}.npy", res.frames)
            for i, shape in enumerate(case.get("decode_checks", [])):
                report[f"{case['name']}-decode{i}"] = gen.collective_rpc(decode_check, args=(shape, i))
            for i, shape in enumerate(case.get("tiling_checks", [])):
                report[f"{case['name']}-tiled{i}"] = gen.collective_rpc(tiling_check, args=(shape, i))
        if dist.get_rank() == 0:
            (out / "report.json").write_text(json.dumps(report, indent=1))
        dist.barrier()


if __name__ == "__main__":
    main()
