"""Two emulated Ray nodes on this machine (ray.cluster_utils.Cluster, 1 CPU each): prints, as JSON, the driver's node
and each rank's node, local rank and local world size, and whether frames came back."""

import json

import ray
from ray.cluster_utils import Cluster

from distvideo import VideoGenerator

nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
try:
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, logging_level="WARNING")
    driver = ray.get_runtime_context().get_node_id()
    with VideoGenerator.from_pretrained(executor="ray", num_gpus=2) as gen:
        placed = gen.collective_rpc(
            lambda w: (ray.get_runtime_context().get_node_id(), w.local_rank, w.rank_info.local_world_size)
        )
        res = gen.generate("a kite", num_frames=5, height=32, width=48, num_inference_steps=2, save_video=False)
    print(json.dumps({"driver": driver, "placed": placed, "frames": res.frames is not None}))
finally:
    ray.shutdown()
    nodes.shutdown()
