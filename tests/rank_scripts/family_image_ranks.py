"""Run by every rank under torchrun (2 ranks): an image file present on rank 0's node and missing on rank 1's.

usage: family_image_ranks.py MODEL IMAGE OUT_DIR

Rank 0 passes IMAGE; rank 1 passes its own path (OUT_DIR/node-1/IMAGE's name), which does not exist, as a job whose
nodes hold different files would. Every rank writes OUT_DIR/rank<r>.json: the error `generate` raised (type and
message) and how many transformer forwards ran (none may: the request is refused before any denoising). Then both
ranks pass the same image (rank 1 a copy at its own path: the same bytes) and must agree and generate.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from distvideo import VideoGenerator

REQUEST = dict(num_frames=5, height=32, width=64, num_inference_steps=2, seed=0, save_video=False)


def count_forwards(worker) -> None:
    worker.forwards = 0

    def hook(module, args):
        worker.forwards += 1

    worker.pipeline.transformer.register_forward_pre_hook(hook)


def main() -> None:
    model, image, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    with VideoGenerator.from_pretrained(model, executor="auto") as gen:
        rank = gen.executor.rank
        own = image if rank == 0 else out / "node-1" / image.name
        gen.collective_rpc(count_forwards)
        report: dict = {"rank": rank}
        try:
            gen.generate("a red fox", image=str(own), **REQUEST)
            report["error"] = None
        except Exception as exc:
            report["error"] = {"type": type(exc).__name__, "message": str(exc)}
        report["forwards_after_refusal"] = gen.collective_rpc(lambda worker: worker.forwards)
        if rank == 1:  # the same bytes at this node's own path
            own.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(image, own)
        gen.collective_rpc(lambda worker: None)  # rank 1 has copied before rank 0 goes on
        res = gen.generate("a red fox", image=str(own), **REQUEST)
        report["then_generated"] = res.frames is not None if rank == 0 else True
        report["forwards_after_success"] = gen.collective_rpc(lambda worker: worker.forwards)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
