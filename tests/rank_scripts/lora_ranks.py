"""Run by every rank under torchrun (2 ranks): LoRA across ranks in one launch, on sp=2 and then on cfg=2.

usage: lora_ranks.py OUT_DIR LORA_A LORA_B

Writes OUT_DIR/rank<r>.json per rank; rank 0 also saves the frames with adapter A at strength 0.7: merged and
unmerged on sp=2 (lora.npy, lora_unmerged.npy) and merged on cfg=2 (lora_cfg.npy).
Checks made here, reported for the test to assert: weight digests equal across ranks; a LoRA file that exists on
rank 0 only (rank 1 gets its own path, which does not exist) fails on both ranks with the same error naming rank 1
and leaves both ranks' weights as they were; ranks given different files are refused; divergent strengths are
refused; clearing restores the base weights bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from distvideo import VideoGenerator
from distvideo.executors.external import DivergentCallError
from distvideo.lora import LoraError
from distvideo.lora.rank import describe, transformer_digest

REQUEST = dict(num_frames=5, height=32, width=48, num_inference_steps=2, seed=0, save_video=False)


def attempt(fn) -> dict:
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": None}


def main() -> None:
    out, lora_a, lora_b = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    report: dict = {}
    with VideoGenerator.from_pretrained(executor="auto", sp_size=2) as gen:
        rank = gen.executor.rank
        report["base"] = gen.collective_rpc(transformer_digest)
        gen.set_lora_adapter("a", lora_a, strength=0.7)
        res = gen.generate("a red fox", **REQUEST)
        if res.frames is not None:
            np.save(out / "lora.npy", res.frames)
        report["with_a"] = gen.collective_rpc(transformer_digest)
        report["state_with_a"] = gen.collective_rpc(describe)
        gen.unmerge_lora_weights()  # on the fly: hooks on the linear layers, under the Ulysses attention processor
        res = gen.generate("a red fox", **REQUEST)
        if res.frames is not None:
            np.save(out / "lora_unmerged.npy", res.frames)
        report["unmerged"] = gen.collective_rpc(transformer_digest)
        gen.merge_lora_weights()

        # a file present on rank 0 only: rank 1 computes its own path, which does not exist
        own_path = lora_b if rank == 0 else str(out / "only-on-rank-0" / "b.safetensors")
        report["missing_on_rank_1"] = attempt(lambda: gen.set_lora_adapter("b", own_path, accumulate=True))
        report["after_failure"] = gen.collective_rpc(transformer_digest)
        report["state_after_failure"] = gen.collective_rpc(describe)

        # different bytes on the two ranks
        report["different_files"] = attempt(lambda: gen.set_lora_adapter("c", lora_a if rank == 0 else lora_b))
        report["after_different_files"] = gen.collective_rpc(transformer_digest)

        # a divergent script: the ranks disagree on the strength
        report["divergent"] = attempt(lambda: gen.set_lora_adapter("a", strength=0.5 + rank))
        report["divergent_is_refused"] = report["divergent"]["type"] == DivergentCallError.__name__

        # arguments invalid on one rank only: refused on both (the other rank is not left waiting)
        report["invalid_on_one_rank"] = attempt(
            lambda: gen.set_lora_adapter("a", lora_a, strength=float("nan") if rank == 1 else 0.5)
        )

        gen.clear_lora_adapters()
        report["after_clear"] = gen.collective_rpc(transformer_digest)
        report["lora_error_name"] = LoraError.__name__
    with VideoGenerator.from_pretrained(executor="auto", sp_size=1, cfg_parallel=True) as gen:
        gen.set_lora_adapter("a", lora_a, strength=0.7)
        res = gen.generate("a red fox", **REQUEST)
        if res.frames is not None:
            np.save(out / "lora_cfg.npy", res.frames)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
