"""Run by every rank under a launcher: what the rank was given and what the engine made of it.

usage: launch_report.py OUT_DIR [generate]

Writes OUT_DIR/rank<r>.json: the MASTER_* and OMP_NUM_THREADS variables the launcher handed over (before the engine
ran), the launch environment the engine resolved, the node (SLURMD_NODENAME), torch's intra-op threads once the
generator exists, and the cores this process may use. With "generate", rank 0 also writes the video OUT_DIR/video.mp4
and the frames OUT_DIR/frames.npy of one request.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

given = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}

import numpy as np  # noqa: E402
import torch  # noqa: E402

from distvideo import VideoGenerator  # noqa: E402

REQUEST = dict(num_frames=5, height=32, width=48, num_inference_steps=2, seed=5)


def main() -> None:
    out = Path(sys.argv[1])
    generate = sys.argv[2:] == ["generate"]
    with VideoGenerator.from_pretrained(executor="external") as gen:
        env = gen.executor.launch_env
        report = {
            "given": given,
            "rank": env.rank,
            "local_rank": env.local_rank,
            "world_size": env.world_size,
            "local_world_size": env.local_world_size,
            "master_addr": env.master_addr,
            "master_port": env.master_port,
            "launcher": env.launcher,
            "node": os.environ.get("SLURMD_NODENAME"),
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "threads": torch.get_num_threads(),
            "cores": len(os.sched_getaffinity(0)),
        }
        if generate:
            res = gen.generate("a red fox", output_path=str(out / "video.mp4"), **REQUEST)
            report["video_path"] = res.video_path
            if res.frames is not None:
                np.save(out / "frames.npy", res.frames)
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
