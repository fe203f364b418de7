"""The Ray executor's own local cluster (the test gives an empty RAY_TMPDIR, so none is found running): prints, as
JSON, the address Ray registered for the node, the rank actors' pids, and the addresses that every process of the
cluster (this driver and its descendants) and every actor listens on, after a generation."""

import json
import os

import psutil
import ray

from distvideo import VideoGenerator

from ray_cluster import listening

with VideoGenerator.from_pretrained(executor="ray", num_gpus=2) as gen:
    actors = gen.collective_rpc(lambda w: os.getpid())
    res = gen.generate("a kite", num_frames=5, height=32, width=48, num_inference_steps=2, save_video=False)
    node = ray.nodes()[0]["NodeManagerAddress"]
    me = psutil.Process()
    seen = listening({me.pid, *actors, *(p.pid for p in me.children(recursive=True))})
print(json.dumps({"node": node, "actors": actors, "listening": seen, "frames": res.frames is not None}))
