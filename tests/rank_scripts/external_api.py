"""Run by every rank under a real launcher: the external executor's API behaviour in one launch.

usage: external_api.py OUT_DIR [CLI_VIDEO]

With CLI_VIDEO, every rank first runs the `distvideo generate` command in-process (as `python -m distvideo generate`
runs it: its own generator, started and shut down) writing CLI_VIDEO, so one launch serves the command's test and
the API's. Writes one JSON file per rank into OUT_DIR (argv[1]); rank 0 also saves its frames as frames.npy. Also reports the
launcher's OMP_NUM_THREADS (read before anything is imported), torch's intra-op threads once the generator exists,
and the cores this process may use: the thread policy per rank is read from this launch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

GIVEN_OMP = os.environ.get("OMP_NUM_THREADS")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from distvideo import VideoGenerator  # noqa: E402
from distvideo.executors.external import DivergentCallError  # noqa: E402

REQUEST = dict(num_frames=5, height=32, width=48, num_inference_steps=2, seed=5)
SMALL = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2", "--seed", "5"]  # the same request


def fail_on_rank_1(worker):
    if worker.rank == 1:
        raise ValueError("planted failure on rank 1")
    return worker.rank


def main() -> None:
    out = Path(sys.argv[1])
    report: dict = {}
    if len(sys.argv) > 2:
        from distvideo.cli.main import main as cli

        argv = ["generate", "--prompt", "a red fox", "--output", sys.argv[2], *SMALL]
        report["cli_exit"] = cli(argv)
    with VideoGenerator.from_pretrained(executor="auto") as gen:
        rank = gen.executor.rank
        report["executor"] = type(gen.executor).__name__
        report["world_size"] = gen.world_size
        report["is_output_rank"] = gen.is_output_rank
        report["launcher"] = gen.executor.launch_env.launcher
        report["threads"] = {"given_omp": GIVEN_OMP, "torch": torch.get_num_threads()}
        report["threads"]["cores"] = len(os.sched_getaffinity(0))
        res = gen.generate("a red fox", output_path=str(out / "video.mp4"), **REQUEST)
        report["video_path"] = res.video_path
        report["has_frames"] = res.frames is not None
        if res.frames is not None:
            np.save(out / "frames.npy", res.frames)
        report["ranks"] = gen.collective_rpc(lambda w: (w.rank, w.world_size, os.getpid()))
        try:
            gen.collective_rpc(fail_on_rank_1)
            report["failure"] = None
        except RuntimeError as exc:
            report["failure"] = str(exc)
        report["ping_after_failure"] = gen.collective_rpc("ping")
        try:
            gen.generate(f"prompt of rank {rank}", save_video=False, **REQUEST)
            report["divergence"] = None
        except DivergentCallError as exc:
            report["divergence"] = str(exc)
        try:
            gen.collective_rpc("ping", timeout=5)
            report["timeout"] = None
        except NotImplementedError as exc:
            report["timeout"] = str(exc)
        report["ping_at_end"] = gen.collective_rpc("ping")
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
