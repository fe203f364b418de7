"""Run by every rank under torchrun: `--model` a Hugging Face repo id missing from the node's hub cache.

usage: hub_download_ranks.py REPO_ID REMOTE_CACHE OUT_DIR

The hub is not reachable from the tests, so huggingface_hub's download is replaced here by a copy from REMOTE_CACHE
(a hub-layout cache holding the repo) that takes a second, as a download would, and logs which rank made it to
OUT_DIR/downloads.log; reading the cache (local_files_only) is huggingface_hub's own. Every rank then loads the model
and generates; OUT_DIR/rank<r>.json says which folder it loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import huggingface_hub

from distvideo import VideoGenerator
from distvideo.testing.hub_cache import repo_folder_name

real_snapshot_download = huggingface_hub.snapshot_download


def main() -> None:
    repo_id, remote, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rank = int(os.environ["RANK"])

    def download(repo: str, **kwargs):
        if kwargs.get("local_files_only"):
            return real_snapshot_download(repo, **kwargs)
        with open(out / "downloads.log", "a") as log:
            log.write(f"rank {rank}\n")
        time.sleep(1.0)
        cache = Path(huggingface_hub.constants.HF_HUB_CACHE)
        shutil.copytree(remote / repo_folder_name(repo), cache / repo_folder_name(repo), symlinks=True)
        return real_snapshot_download(repo, local_files_only=True)

    huggingface_hub.snapshot_download = download
    with VideoGenerator.from_pretrained(repo_id, executor="auto") as gen:
        res = gen.generate("a fox", num_frames=5, height=32, width=64, num_inference_steps=1, save_video=False)
        report = {"model": str(gen.model_info.path), "frames": res.frames is not None}
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
