"""The image conditioning on two ranks: rank 0 computing it and broadcasting the result (what distvideo does) against
every rank computing it itself, with the benchmark-sized checkpoints of benchmarks/families.py.

Two ranks of the mp executor (cfg=2, one thread each). For each family, `--repeats` alternations of:
- every rank: a barrier, then every rank computes the conditioning (Wan2.1 I2V: CLIP and the VAE encode of the
  first-frame video; TI2V-5B: the VAE encode of the image), then a barrier: the wall time until the slower rank is
  done;
- broadcast: a barrier, rank 0 computes it while rank 1 waits, then rank 0 broadcasts the condition latents (and the
  CLIP tokens) over gloo with distvideo's broadcast_tensors: the wall time until the slower rank has them, and rank
  0's broadcast alone.
Medians, and whether the ranks' own results were bit-identical (sha256; what rank 1 received always is).

    python benchmarks/conditioning.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

REQUESTS = {
    "wan21_i2v": dict(num_frames=33, height=192, width=192),
    "wan22_ti2v_5b": dict(num_frames=33, height=192, width=192),
}


def measure(worker: Any, image: str, request: dict[str, Any], repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from distvideo.parallel.collectives import broadcast_tensors
    from distvideo.pipelines.conditioning import pil_image, tensor_digest
    from distvideo.request import GenerationRequest

    pipeline = worker.pipeline
    resolved = worker.model_info.resolve_request(GenerationRequest(prompt="x", image=image, **request))

    def condition() -> list[torch.Tensor]:
        """The pipeline's own computation of the conditioning, without its broadcast."""
        from distvideo.families.wan.i2v import ImageBatch

        with torch.no_grad():
            if not hasattr(pipeline, "first_frame_condition"):  # TI2V-5B
                return [pipeline.image_latents(resolved)]
            batch = ImageBatch(request=resolved, image=pil_image(resolved.image))
            clip = [pipeline.clip_tokens(batch)] if pipeline.image_encoder is not None else []
            return [*clip, pipeline.first_frame_condition(batch)]

    every, broadcast, sending = [], [], []
    digests = [tensor_digest(t) for t in condition()]  # also the warm-up
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        condition()
        dist.barrier()
        every.append(time.perf_counter() - start)

        dist.barrier()
        start = time.perf_counter()
        computed = condition() if worker.rank == 0 else None
        sent = time.perf_counter()
        received = broadcast_tensors(computed, group=dist.group.WORLD, device=worker.device)  # as distvideo does
        broadcast.append(time.perf_counter() - start)
        sending.append(time.perf_counter() - sent)
        assert [tensor_digest(t) for t in received] == digests
    return {
        "every_rank_s": statistics.median(every),
        "broadcast_s": statistics.median(broadcast),
        "broadcast_only_s": statistics.median(sending),
        "digests": digests,
        "bytes": sum(t.numel() * t.element_size() for t in condition()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", default="/tmp/distvideo-benchmark-families")
    args = parser.parse_args()
    from families import build

    from distvideo import VideoGenerator

    paths = build(Path(args.folder))
    image = str(Path(args.folder) / "image.png")
    print("| family | conditioning input | every rank computes (s) | rank 0 + broadcast (s) | broadcast alone (s) "
          "| bytes sent | identical on both ranks |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for family, request in REQUESTS.items():
        with VideoGenerator.from_pretrained(paths[family], num_gpus=2, executor="mp", cfg_parallel=True) as gen:
            results = gen.collective_rpc(measure, args=(image, request, args.repeats))
        slowest = {k: max(r[k] for r in results) for k in ("every_rank_s", "broadcast_s")}
        slowest["broadcast_only_s"] = results[0]["broadcast_only_s"]  # rank 0's send (rank 1 waits for its encode)
        same = all(r["digests"] == results[0]["digests"] for r in results)
        shape = f"{request['num_frames']} x {request['height']} x {request['width']}"
        print(f"| {family} | {shape} | {slowest['every_rank_s']:.3f} | {slowest['broadcast_s']:.3f} | "
              f"{slowest['broadcast_only_s']:.4f} | {results[0]['bytes']} | {same} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
