"""Two emulated Ray nodes on this machine (ray.cluster_utils.Cluster, 1 CPU each): prints, as JSON, the driver's node
and each rank's node, local rank and local world size, whether frames came back, the store the executor offers the
service's replicas; then `distvideo serve --replicas 2` on the same two nodes (one rank per node): two jobs
at once (nearly always one on each replica), and what they left (their statuses, replicas, video digests, the same request's digest on
one inline rank, and any private file store the server made in its TMPDIR)."""

import hashlib
import json
import tempfile
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from distvideo import VideoGenerator

from serving_harness import SMALL, start_server

# a job of some 20 steps: the first is nearly always still running when the second arrives, which then goes to the
# other replica (the test counts the jobs, not where they ran)
JOB = {**SMALL, "num_inference_steps": 20}


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


work = Path(tempfile.mkdtemp(prefix="distvideo-two-nodes-"))
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
        store = gen.executor.rendezvous_store()
    seen = {"driver": driver, "placed": placed, "frames": res.frames is not None, "store": [store.host, store.port]}

    server_tmp = work / "tmp"
    server_tmp.mkdir()
    args = ["--ray-address", nodes.address, "--replicas", "2"]
    with start_server(work / "serve", "ray", args=args, env={"TMPDIR": str(server_tmp)}) as server:
        jobs = [server.create(prompt="two nodes", **JOB) for _ in range(2)]
        done = [server.wait(job["id"])["status"] for job in jobs]
        health = server.http.get("/health").json()
        seen["private_stores"] = sorted(p.name for p in server_tmp.glob("distvideo-store-*"))
        videos = [server.output / f"{job['id']}.mp4" for job in jobs]
        videos = [digest(v) for v in videos if v.exists()]
    seen.update(done=done, jobs_done=[r["jobs_done"] for r in health["replicas"]], videos=videos)
    width, height = (int(v) for v in JOB["size"].split("x"))
    request = {k: JOB[k] for k in ("num_frames", "num_inference_steps", "seed")}
    with VideoGenerator.from_pretrained(executor="inline", progress=False) as gen:  # one rank: a replica's layout
        reference = gen.generate("two nodes", width=width, height=height, **request, output_path=str(work / "ref.mp4"))
    seen["reference"] = digest(reference.video_path)
    print(json.dumps(seen))
finally:
    ray.shutdown()
    nodes.shutdown()
