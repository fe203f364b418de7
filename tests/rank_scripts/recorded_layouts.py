"""Run by every rank of a 2-rank torchrun launch: the recorded request on every 2-rank layout of the external
executor, one generator per layout (sp=2, cfg=2, and a batch of two items over 2 replicas).

usage: recorded_layouts.py CHECKPOINT OUT_DIR

Rank 0 writes OUT_DIR/frames.npz (one array per layout, two for the replicas) and OUT_DIR/videos.json (the sha256 of
each video written). The same script records the frames from an old commit's code (scripts/record_frames.py) and
checks today's against them (tests/test_frames_recorded.py), so both run exactly this.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests folder: the recorded request

from distvideo import VideoGenerator
from test_frames_recorded import PROMPT, REQUEST

#: layout name -> engine options (2 ranks each)
LAYOUTS = {
    "torchrun_sp2": dict(cfg_parallel=False, sp_size=2),
    "torchrun_cfg2": dict(cfg_parallel=True, sp_size=1),
}
REPLICA_PROMPTS = [PROMPT, "a paper boat on a pond"]


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main() -> None:
    checkpoint, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    frames: dict[str, np.ndarray] = {}
    videos: dict[str, str] = {}
    request = {k: v for k, v in REQUEST.items() if k != "save_video"}
    for name, options in LAYOUTS.items():
        with VideoGenerator.from_pretrained(checkpoint, executor="external", **options) as gen:
            result = gen.generate(PROMPT, output_path=str(out / f"{name}.mp4"), **request)
            if gen.is_output_rank:
                frames[name] = result.frames
                videos[name] = sha256(result.video_path)
    with VideoGenerator.from_pretrained(checkpoint, executor="external", replicas=2) as gen:
        rank = gen.executor.rank
        items = [{"prompt": p, "seed": REQUEST["seed"] + i} for i, p in enumerate(REPLICA_PROMPTS)]
        fields = {k: v for k, v in request.items() if k != "seed"}
        results = gen.generate_batch(items, output_dir=out / "replicas", return_frames=True, progress=False, **fields)
        for result in results:
            if result.frames is not None:  # each replica's output rank holds its own items
                frames[f"torchrun_replicas2_item{result.index}"] = result.frames
            if result.video_path is not None:
                videos[f"torchrun_replicas2_item{result.index}"] = sha256(result.video_path)
    np.savez(out / f"frames-rank{rank}.npz", **frames)
    (out / f"videos-rank{rank}.json").write_text(json.dumps(videos, sort_keys=True))


def read_outputs(out: Path) -> dict[str, np.ndarray]:
    """What the two ranks wrote into `out`: every layout's frames, and `<name>_video` the sha256 of its video (a 0-d
    string array, so frames and hashes live in one .npz)."""
    recorded: dict[str, np.ndarray] = {}
    for rank in (0, 1):
        with np.load(out / f"frames-rank{rank}.npz") as data:
            recorded.update({name: data[name] for name in data.files})
        videos = json.loads((out / f"videos-rank{rank}.json").read_text())
        recorded.update({f"{name}_video": np.array(digest) for name, digest in videos.items()})
    return recorded


if __name__ == "__main__":
    main()
