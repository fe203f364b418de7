"""Every rank under a launcher: a request past its request_timeout, then one cancelled on rank 1 only, then a normal
one; writes OUT_DIR/rank<N>.json with what each call raised and the steps each rank saw."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from distvideo import GenerationCancelled, GenerationTimeout, VideoGenerator

REQUEST = dict(num_frames=9, height=32, width=48, seed=1, save_video=False)


def main() -> None:
    out = Path(sys.argv[1])
    report: dict = {}
    with VideoGenerator.from_pretrained(executor="external") as gen:
        rank = gen.executor.rank
        try:
            gen.generate("a tiny boat", num_inference_steps=400, request_timeout=0.001, **REQUEST)
            report["timeout"] = None
        except GenerationTimeout as exc:
            report["timeout"] = str(exc)
        seen: list[int] = []

        def progress(done: int, total: int) -> None:
            seen.append(done)
            if rank == 1 and done == 3:
                gen.cancel()  # only rank 1 cancels: every rank must stop at the same step

        try:
            gen.generate("a tiny boat", num_inference_steps=400, on_progress=progress, **REQUEST)
            report["cancel"] = None
        except GenerationCancelled as exc:
            report["cancel"] = f"{type(exc).__name__}: {exc}"
        report["steps_seen"] = seen
        res = gen.generate("a tiny boat", num_inference_steps=2, **REQUEST)
        report["after"] = None if res.frames is None else list(res.frames.shape)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
