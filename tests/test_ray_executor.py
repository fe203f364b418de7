"""The Ray executor on a real Ray cluster on this machine (started once for the module, on 127.0.0.1, 4 CPUs, no
dashboard): parity with inline and byte-identical videos with mp, a rank's actor killed mid-generation, resources and
addresses refused at once, batch and serve through the CLI, and two emulated nodes (ray.cluster_utils.Cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import ray  # make setup installs distvideo[ray]: a missing Ray fails here

from distvideo import VideoGenerator
from distvideo.errors import ConfigError, WorkerDiedError
from distvideo.executors.ray_executor import rank_order

from conftest import REPO, max_abs_diff
from contract_checks import PROMPT, REQUEST
from launchers import console_script
from serving_harness import SMALL, start_server

pytestmark = pytest.mark.slow
TESTS_ON_PATH = {"env_vars": {"PYTHONPATH": str(REPO / "tests")}}


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster this test process owns (the executor joins it and leaves it running). Its actors import
    this module's functions as spawned mp workers do: the tests folder is on their path (a job's runtime_env)."""
    context = ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        num_cpus=4,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env=TESTS_ON_PATH,
    )
    yield context.address_info["gcs_address"]
    ray.shutdown()


def leftovers(within: float = 10.0) -> tuple[list, float]:
    """(placement groups not removed, CPUs still held): ([], 0) once every actor and placement group is gone."""
    deadline = time.monotonic() + within
    while True:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
        if (not groups and held == 0) or time.monotonic() > deadline:
            return groups, held
        time.sleep(0.2)


def test_frames_match_inline_and_the_video_is_byte_identical_to_mp(cluster, tmp_path):
    with VideoGenerator.from_pretrained(executor="inline") as gen:
        reference = gen.generate(PROMPT, **REQUEST).frames
    request = {**REQUEST, "save_video": True}
    videos = {}
    for executor in ("mp", "ray"):
        with VideoGenerator.from_pretrained(executor=executor, num_gpus=2) as gen:
            assert gen.collective_rpc(lambda w: (w.rank, w.world_size)) == [(0, 2), (1, 2)]
            res = gen.generate(PROMPT, **request, output_path=str(tmp_path / f"{executor}.mp4"))
            assert max_abs_diff(res.frames, reference) <= 2
            videos[executor] = (tmp_path / f"{executor}.mp4").read_bytes()
    assert videos["ray"] == videos["mp"]
    assert leftovers() == ([], 0), "shutdown left actors or placement groups"


def test_events_cancel_and_timeouts(cluster):
    with VideoGenerator.from_pretrained(executor="ray", num_gpus=2) as gen:
        steps = []
        res = gen.generate(PROMPT, **{**REQUEST, "num_inference_steps": 3}, on_progress=lambda d, t: steps.append(d))
        assert steps == [1, 2, 3] and res.frames is not None
        with pytest.raises(RuntimeError, match="rank 1: ValueError: planted"):
            gen.collective_rpc(_fail_on_rank_1)
        assert gen.collective_rpc("ping") == [0, 1], "usable after a failure"
        with pytest.raises(TimeoutError, match=r"timed out after 1 s: no answer from rank 0, rank 1"):
            gen.collective_rpc(lambda w: time.sleep(30), timeout=1)
    assert leftovers() == ([], 0)


def _fail_on_rank_1(worker):
    if worker.rank == 1:
        raise ValueError("planted")
    return worker.rank


def test_cancel_from_another_thread_stops_every_rank(cluster):
    from distvideo.errors import GenerationCancelled

    with VideoGenerator.from_pretrained(executor="ray", num_gpus=2) as gen:
        seen = threading.Event()

        def progress(done, total):
            seen.set()

        threading.Timer(0.0, lambda: seen.wait(60) and gen.cancel()).start()
        with pytest.raises(GenerationCancelled):
            gen.generate(PROMPT, **{**REQUEST, "num_inference_steps": 40}, on_progress=progress)
        assert gen.collective_rpc("ping") == [0, 1], "usable after a cancel"


def test_an_actor_killed_mid_generation_is_reported_within_seconds(cluster):
    gen = VideoGenerator.from_pretrained(executor="ray", num_gpus=2)
    pid = gen.collective_rpc(lambda w: os.getpid())[1]
    threading.Timer(1.0, lambda: os.kill(pid, 9)).start()
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        gen.generate(PROMPT, **{**REQUEST, "num_inference_steps": 200})
    assert time.monotonic() - started < 30, "a dead actor must be seen at once, not at dist_timeout"
    with pytest.raises(RuntimeError, match="dead"):
        gen.collective_rpc("ping")
    gen.shutdown()
    assert leftovers() == ([], 0)


def test_too_few_resources_and_unreachable_addresses_fail_at_once(cluster):
    with pytest.raises(ConfigError, match=r"8 bundle\(s\) \{'CPU': 1.0\} needed .* it has CPU=4"):
        VideoGenerator.from_pretrained(executor="ray", num_gpus=8)
    assert leftovers() == ([], 0)
    with pytest.raises(ConfigError, match="ray_address='nowhere'"):
        VideoGenerator.from_pretrained(executor="ray", ray_address="nowhere")
    with pytest.raises(ConfigError, match="only used with executor='ray'"):
        VideoGenerator.from_pretrained(executor="mp", num_gpus=2, ray_address="auto")
    started = time.monotonic()  # a fresh process, not yet connected to any cluster
    proc = _cli(["generate", "--prompt", "x", "--executor", "ray", "--ray-address", "127.0.0.1:9"], timeout=60)
    assert proc.returncode == 2 and "127.0.0.1:9" in proc.stderr, proc.stderr
    assert time.monotonic() - started < 30


def test_rank_order_puts_the_driver_node_first_grouped_by_node():
    assert rank_order("b", ["a", "b", "a", "b"]) == [1, 3, 0, 2]
    assert rank_order("x", ["a", "c", "a"]) == [0, 2, 1]


def _cli(args, timeout=300):
    env = {**os.environ, "DISTVIDEO_NO_PROGRESS": "1"}
    cmd = [console_script("distvideo"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def test_batch_and_a_served_job(cluster, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red kite\na blue kite\n")
    out = tmp_path / "batch"
    small = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2"]
    proc = _cli(
        [
            *("generate", "--prompts", str(prompts), "--executor", "ray", "--num-gpus", "2", "--replicas", "2"),
            *("--ray-address", cluster, "--output", str(out), *small),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(list(out.glob("*.mp4"))) == 2
    with start_server(tmp_path / "serve", "ray", args=["--ray-address", cluster]) as server:
        video = server.create(prompt="a boat", **SMALL)
        assert server.wait(video["id"])["status"] == "completed"
    assert leftovers() == ([], 0)


def test_two_emulated_nodes_order_ranks_by_node():
    script = REPO / "tests" / "rank_scripts" / "ray_two_nodes.py"
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    (node0, local0, count0), (node1, local1, count1) = seen["placed"]
    assert node0 == seen["driver"] and node1 != node0, "one rank per node, the driver's node first"
    assert (local0, count0, local1, count1) == (0, 1, 0, 1)
    assert seen["frames"]
