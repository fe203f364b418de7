"""Run by every rank under torchrun: the model families on several parallel layouts in one launch.

usage: family_cases.py CASES_JSON OUT_DIR

CASES_JSON holds a list of engines, each {"name", "model", "sp_size", "cfg_parallel", "requests": [{"name",
"kwargs"}], "decode_checks": [latent shapes], "refusals": [{"name", "kwargs"}], "own_copies": [{"name", "kwargs"}]}. A refusal is a request whose image exists on rank 0 only: every other rank passes its own path
(OUT_DIR/node-<rank>/<name>), which does not exist; its report is the error each rank raised and the collectives
counted meanwhile (none may run: the request is refused before any denoising). An own copy is a request whose image
every rank first copies to a path of its own (OUT_DIR/own-copy-<rank>/<name>) and passes; its report is each rank's
path and error. Every engine is a VideoGenerator on the external executor. Rank 0
saves each request's frames as OUT_DIR/<engine>-<request>.npy and writes OUT_DIR/report.json with, per request and
rank: whether the rank holds frames, the plans' collective counters, the digest of the image conditioning the rank
computed (CLIP tokens and condition latents), its time, and the experts' swaps; and per decode check the float
difference between the banded decode and a single-rank decode of the same latents.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distvideo import VideoGenerator
from distvideo.pipelines.conditioning import tensor_digest


def record_conditioning(worker: Any) -> None:
    """Wrap this rank's conditioning stage so it records a digest of what it computed and how long it took."""
    pipeline = worker.pipeline
    pipeline.test_record = {}
    stage_name = next((n for n in ("condition_on_first_frame", "condition_on_image") if hasattr(pipeline, n)), None)
    if stage_name is None:  # a text-to-video family
        return
    stage = getattr(pipeline, stage_name)
    image_stage = getattr(pipeline, "encode_image", None)

    def conditioned(batch: Any) -> None:
        start = time.perf_counter()
        stage(batch)
        pipeline.test_record["condition_s"] = time.perf_counter() - start
        pipeline.test_record["condition"] = tensor_digest(getattr(batch, "condition", None))

    def encoded(batch: Any) -> None:
        image_stage(batch)
        pipeline.test_record["image_embeds"] = tensor_digest(getattr(batch, "image_embeds", None))

    setattr(pipeline, stage_name, conditioned)
    if image_stage is not None:
        pipeline.encode_image = encoded


def rank_report(worker: Any) -> dict[str, Any]:
    p = worker.parallel
    residency = getattr(worker.pipeline, "residency", None)
    return {
        "context": dict(p.counts),
        "ulysses": dict(p.ulysses.counts) if p.ulysses is not None else {},
        "vae": dict(p.vae_decoder.counts),
        "conditioning": dict(getattr(worker.pipeline, "test_record", {})),
        "experts": dict(residency.counts) if residency is not None else None,
    }


def reset_counts(worker: Any) -> None:
    p = worker.parallel
    for counter in (p.counts, p.vae_decoder.counts, *([p.ulysses.counts] if p.ulysses is not None else [])):
        counter.clear()
    getattr(worker.pipeline, "test_record", {}).clear()


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


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    report: dict[str, Any] = {}
    with ExitStack() as stack:  # the first generator owns the process group: it is shut down last
        for case in cases:
            gen = stack.enter_context(
                VideoGenerator.from_pretrained(
                    case["model"], executor="external", sp_size=case["sp_size"], cfg_parallel=case["cfg_parallel"]
                )
            )
            gen.collective_rpc(record_conditioning)
            for request in case["requests"]:
                key = f"{case['name']}-{request['name']}"
                gen.collective_rpc(reset_counts)
                res = gen.generate("a red fox running through snow", save_video=False, **request["kwargs"])
                per_rank: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, res.frames is not None)
                report[key] = {"ranks": gen.collective_rpc(rank_report), "has_frames": per_rank}
                if gen.is_output_rank:
                    np.save(out / f"{key}.npy", res.frames)
            for refusal in case.get("refusals", []):
                key = f"{case['name']}-{refusal['name']}"
                gen.collective_rpc(reset_counts)
                kwargs = dict(refusal["kwargs"])
                if dist.get_rank() != 0:
                    kwargs["image"] = str(out / f"node-{dist.get_rank()}" / Path(kwargs["image"]).name)
                try:
                    gen.generate("a red fox running through snow", save_video=False, **kwargs)
                    error = None
                except Exception as exc:
                    error = {"type": type(exc).__name__, "message": str(exc)}
                errors: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(errors, error)
                report[key] = {"ranks": gen.collective_rpc(rank_report), "errors": errors}
            for copy in case.get("own_copies", []):  # the same bytes at another path on every rank
                key = f"{case['name']}-{copy['name']}"
                kwargs = dict(copy["kwargs"])
                own = out / f"own-copy-{dist.get_rank()}" / Path(kwargs["image"]).name
                own.parent.mkdir(exist_ok=True)
                own.write_bytes(Path(kwargs["image"]).read_bytes())
                kwargs["image"], error = str(own), None
                try:
                    res = gen.generate("a red fox running through snow", save_video=False, **kwargs)
                    if gen.is_output_rank:
                        np.save(out / f"{key}.npy", res.frames)
                except Exception as exc:
                    error = {"type": type(exc).__name__, "message": str(exc)}
                outcomes: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(outcomes, {"image": kwargs["image"], "error": error})
                report[key] = outcomes
            for i, shape in enumerate(case.get("decode_checks", [])):
                report[f"{case['name']}-decode{i}"] = gen.collective_rpc(decode_check, args=(shape, i))
        if dist.get_rank() == 0:
            (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
