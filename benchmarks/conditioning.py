"""The image conditioning on two ranks: every rank computing it itself (what distvideo does) against rank 0 computing
it and broadcasting the result (the alternative), with the benchmark-sized checkpoints of benchmarks/families.py.

Two ranks of the mp executor (cfg=2, one thread each). For each family, `--repeats` alternations of:
- every rank: a barrier, then every rank runs the pipeline's conditioning stage (Wan2.1 I2V: CLIP and the VAE
  encode of the first-frame video; TI2V-5B: the VAE encode of the image), then a barrier: the wall time until the
  slower rank is done;
- broadcast: a barrier, rank 0 runs the stage while rank 1 waits, then rank 0 broadcasts the condition latents (and
  the CLIP tokens) over gloo: the wall time, and the broadcast alone.
Medians, and whether the ranks' own results were bit-identical (sha256).

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

    from distvideo.config import GenerationRequest
    from distvideo.pipelines.conditioning import pil_image, tensor_digest

    pipeline = worker.pipeline
    resolved = worker.model_info.resolve_request(GenerationRequest(prompt="x", image=image, **request))
    stages = [getattr(pipeline, n) for n in ("encode_image", "condition_on_first_frame", "condition_on_image")]
    stages = [s for s in stages if s is not None]

    def batch() -> Any:
        from distvideo.pipelines.wan22_ti2v import TokenTimestepBatch
        from distvideo.pipelines.wan_i2v import ImageBatch

        cls = ImageBatch if hasattr(pipeline, "condition_on_first_frame") else TokenTimestepBatch
        b = cls(request=resolved, image=pil_image(resolved.image)) if cls is ImageBatch else cls(request=resolved)
        pipeline.prepare_latents(b)
        return b

    def condition(b: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            for stage in stages:
                stage(b)
        return [t for t in (getattr(b, "image_embeds", None), b.condition) if t is not None]

    every, broadcast, sending = [], [], []
    digests = [tensor_digest(t) for t in condition(batch())]  # also the warm-up
    for _ in range(repeats):
        b = batch()
        dist.barrier()
        start = time.perf_counter()
        condition(b)
        dist.barrier()
        every.append(time.perf_counter() - start)

        b = batch()
        shapes = [t.shape for t in condition(batch())]  # known in advance in a real broadcast (from the request)
        dist.barrier()
        start = time.perf_counter()
        tensors = condition(b) if worker.rank == 0 else [torch.empty(s) for s in shapes]
        sent = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, src=0)
        broadcast.append(time.perf_counter() - start)
        sending.append(time.perf_counter() - sent)
    return {
        "every_rank_s": statistics.median(every),
        "broadcast_s": statistics.median(broadcast),
        "broadcast_only_s": statistics.median(sending),
        "digests": digests,
        "bytes": sum(t.numel() * t.element_size() for t in condition(batch())),
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
        slowest = {k: max(r[k] for r in results) for k in ("every_rank_s", "broadcast_s", "broadcast_only_s")}
        same = all(r["digests"] == results[0]["digests"] for r in results)
        shape = f"{request['num_frames']} x {request['height']} x {request['width']}"
        print(f"| {family} | {shape} | {slowest['every_rank_s']:.3f} | {slowest['broadcast_s']:.3f} | "
              f"{slowest['broadcast_only_s']:.4f} | {results[0]['bytes']} | {same} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
