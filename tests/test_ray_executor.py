"""The Ray executor on a real Ray cluster on this machine (one for the session, tests/ray_cluster.py: 127.0.0.1, 4
CPUs, no dashboard): step caching with mp's skipped steps and video bytes, a rank's actor killed mid-generation and
while idle, resources and addresses refused at once, batch and serve through the CLI, two
emulated nodes (ray.cluster_utils.Cluster), and nothing of a cluster the executor starts itself listening beyond
loopback. The executor contract and cancellation run on Ray in test_executor_contract.py and test_cancel.py."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import numpy as np
import pytest
import ray  # noqa: F401 (make setup installs distvideo[ray]: a missing Ray fails here)

from distvideo import VideoGenerator
from distvideo.errors import ConfigError, WorkerDiedError
from distvideo.executors.ray_placement import rank_order, rendezvous_kind

from background import BackgroundJob, FolderJob, popen, run_program
from conftest import REPO
from contract_checks import PROMPT, REQUEST
from launchers import console_script, free_port
from processes import wait_gone
from ray_cluster import is_loopback, leftovers, session_cluster  # noqa: F401 (the fixture ray_cluster)
from serving_harness import SMALL, start_server

pytestmark = pytest.mark.slow


def _script_on_a_cluster_of_its_own(
    script: str, timeout: float, stopping: threading.Event, environ: dict[str, str]
) -> CompletedProcess[str]:
    """A rank script in a fresh process, with nothing of the session's cluster in its environment and an empty
    RAY_TMPDIR of its own (kept short: Ray's socket paths are limited), so the clusters it starts are found by no other
    test, nor is `ray start`'s record in /tmp/ray that test_joins_the_cluster_ray_start_made reads touched."""
    ray_tmp = tempfile.mkdtemp(prefix="dvray-", dir="/tmp")
    env = {k: v for k, v in environ.items() if not k.startswith("RAY_")}
    path = os.pathsep.join(filter(None, [str(REPO / "tests"), environ.get("PYTHONPATH")]))
    env.update(PYTHONPATH=path, RAY_TMPDIR=ray_tmp, DISTVIDEO_NO_PROGRESS="1")
    try:
        return run_program([sys.executable, str(REPO / "tests" / "rank_scripts" / script)], stopping, timeout, env=env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


# Two scripts that each start a cluster of their own and print what they saw (10 s and 20 s): they run in the
# background while the rest of the suite runs (background.py), and their tests check what they printed.
LOOPBACK = BackgroundJob("ray_loopback.py", functools.partial(_script_on_a_cluster_of_its_own, "ray_loopback.py", 120))
TWO_NODES = BackgroundJob(
    "ray_two_nodes.py", functools.partial(_script_on_a_cluster_of_its_own, "ray_two_nodes.py", 400)
)
BACKGROUND_JOBS = {"loopback_run": LOOPBACK.hooks, "two_nodes_run": TWO_NODES.hooks}


@pytest.fixture
def loopback_run() -> CompletedProcess[str]:
    return LOOPBACK.result()


@pytest.fixture
def two_nodes_run() -> CompletedProcess[str]:
    return TWO_NODES.result()


def test_events_cancel_and_timeouts(ray_cluster):
    """(A cancel from another thread, on the Ray executor too: tests/test_cancel.py, its `ray` case.)"""
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


def test_an_actor_killed_mid_generation_is_reported_within_seconds(ray_cluster):
    """The kill follows the first step's progress event and waits until the actor is gone: every step has a
    collective, so rank 0 cannot finish the 200 steps without rank 1 (a timer raced a generation that took 1 s)."""
    gen = VideoGenerator.from_pretrained(executor="ray", num_gpus=2)
    pid = gen.collective_rpc(lambda w: os.getpid())[1]

    def kill_rank_1_once(done, total):
        if done == 1:
            os.kill(pid, signal.SIGKILL)
            assert wait_gone([pid], within=10) == []

    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        gen.generate(PROMPT, **{**REQUEST, "num_inference_steps": 200}, on_progress=kill_rank_1_once)
    assert time.monotonic() - started < 30, "a dead actor must be seen at once, not at dist_timeout"
    with pytest.raises(RuntimeError, match="dead"):
        gen.collective_rpc("ping")
    gen.shutdown()
    assert leftovers() == ([], 0)


def test_too_few_resources_and_unreachable_addresses_fail_at_once(ray_cluster):
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


def _ray_start_then_generate(folder: Path, environ: dict[str, str]) -> dict[str, Any]:
    """`ray start --head` with a RAY_TMPDIR of its own (where it records its address, which no other test reads or
    writes), then two `distvideo generate --executor ray` with no address. The cluster is a process group of its own
    (`--block`), killed as a group: on SIGTERM `ray start` takes 30 s to stop, and `ray stop` would stop every cluster
    of this machine."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="dvray-", dir="/tmp"))  # short: Ray's socket paths are limited
    env = {k: v for k, v in environ.items() if not k.startswith("RAY_")}  # RAY_ADDRESS, RAY_AUTH_MODE among them
    env.update(RAY_TMPDIR=str(ray_tmp), RAY_USAGE_STATS_ENABLED="0", DISTVIDEO_NO_PROGRESS="1")
    recorded = ray_tmp / "ray" / "ray_current_cluster"
    port = free_port()
    ray_cli = Path(sys.executable).with_name("ray")
    start = [str(ray_cli), "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=false"]
    with open(folder / "ray-start.log", "w") as log:
        head = popen(start, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (recorded.exists() and recorded.read_text().strip().endswith(f":{port}")):
            if head.poll() is not None or time.monotonic() > deadline:
                return {"started": False, "log": (folder / "ray-start.log").read_text()}
            time.sleep(0.2)
        small = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2", "--no-progress"]
        cli = [console_script("distvideo"), "generate", "--executor", "ray", *small]
        too_many = run_program([*cli, "--prompt", "x", "--num-gpus", "3"], threading.Event(), 300, env=env, cwd=REPO)
        out = folder / "kite.mp4"
        argv = [*cli, "--prompt", "a red kite", "--num-gpus", "2", "--output", str(out)]
        kite = run_program(argv, threading.Event(), 300, env=env, cwd=REPO)
        return {"started": True, "too_many": too_many, "kite": kite, "video": out}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


# a cluster of its own and two programs whose outcome is all the test checks: in the background (background.py)
RAY_START = FolderJob("ray start, then generate with no address", "ray-start", _ray_start_then_generate)
BACKGROUND_JOBS["ray_start_run"] = RAY_START.hooks
ray_start_run = RAY_START.fixture("ray_start_run")


def test_joins_the_cluster_ray_start_made(ray_start_run):
    """docs/launching.md's recipe: `ray start --head`, then `distvideo generate --executor ray` with no address joins
    that cluster. `ray start` turns on token authentication, which Ray applies only to a cluster it finds itself:
    joining the resolved address instead failed with "Failed to connect to Ray cluster"."""
    _, run = ray_start_run
    assert run["started"], f"ray start did not come up:\n{run['log']}"
    too_many, kite = run["too_many"], run["kite"]
    assert too_many.returncode == 2 and "it has CPU=2" in too_many.stderr, too_many.stderr  # that cluster's 2 CPUs
    assert kite.returncode == 0 and run["video"].stat().st_size > 0, kite.stderr


def test_rank_order_puts_the_driver_node_first_grouped_by_node():
    assert rank_order("b", ["a", "b", "a", "b"]) == [1, 3, 0, 2]
    assert rank_order("x", ["a", "c", "a"]) == [0, 2, 1]


def test_ranks_meet_in_a_file_store_beside_the_driver_else_on_loopback_on_one_machine():
    addresses = {"a": "10.0.0.1", "b": "10.0.0.1", "c": "10.0.0.2"}
    assert rendezvous_kind("a", ["a", "a"], addresses) == ("file", None)
    assert rendezvous_kind("a", ["a", "b"], addresses) == ("env", "127.0.0.1")  # emulated nodes: one machine
    assert rendezvous_kind("c", ["a", "c"], addresses) == ("env", "10.0.0.1")


def test_an_actor_that_dies_while_idle_is_noticed_at_once(ray_cluster):
    gen = VideoGenerator.from_pretrained(executor="ray", num_gpus=2)
    pids = gen.collective_rpc(lambda w: os.getpid())
    logged: list[logging.LogRecord] = []  # a handler of its own: distvideo's logger may not propagate to pytest's
    handler = logging.Handler(logging.ERROR)
    handler.emit = logged.append  # type: ignore[method-assign]
    logging.getLogger("distvideo.executors.ray_executor").addHandler(handler)
    os.kill(pids[1], 9)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            gen.check_health()
        except WorkerDiedError as exc:
            assert "rank 1 died" in str(exc) and "while idle" in str(exc)
            break
        time.sleep(0.1)
    else:
        pytest.fail("check_health() did not report the dead actor within 15 s")
    logging.getLogger("distvideo.executors.ray_executor").removeHandler(handler)
    assert any("rank 1 died" in r.getMessage() for r in logged), "logged when seen, not at the next call"
    assert wait_gone([pids[0]], within=10) == [], "the other rank's actor was killed"
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        gen.collective_rpc("ping")
    with pytest.raises(RuntimeError, match="dead: rank 1 died"):
        gen.collective_rpc("ping")
    gen.shutdown()
    assert leftovers() == ([], 0)


def test_first_block_cache_skips_the_same_steps_as_on_mp_and_the_video_is_the_same_bytes(ray_cluster, tmp_path):
    """sp2 on both, the first-block metric all-reduced over the sp group: the same skipped steps, frames and video
    file. (Parity with inline and mp's frames at the default layout: test_executor_contract.py's ray case.)"""
    from distvideo.testing.checkpoints import build_test_checkpoint

    model = build_test_checkpoint(tmp_path / "tiny-wan-4l")  # the 4-layer checkpoint test_caching.py calibrates on
    request = dict(num_frames=9, height=48, width=48, num_inference_steps=8, guidance_scale=5.0, seed=3)
    results, videos = {}, {}
    for executor in ("mp", "ray"):
        with VideoGenerator.from_pretrained(
            str(model), executor=executor, num_gpus=2, sp_size=2, cfg_parallel=False, device="cpu"
        ) as gen:
            assert gen.collective_rpc(lambda w: (w.rank, w.world_size)) == [(0, 2), (1, 2)]
            video = tmp_path / f"{executor}.mp4"
            results[executor] = gen.generate(
                PROMPT, output_path=str(video), cache="first-block", cache_threshold=0.6, **request
            )
            videos[executor] = video.read_bytes()
    skipped = results["ray"].cache["skipped_steps"]
    assert 0 < len(skipped) < 7, results["ray"].cache  # some steps skipped, not all
    assert results["ray"].cache == results["mp"].cache
    assert np.array_equal(results["ray"].frames, results["mp"].frames)
    assert videos["ray"] == videos["mp"]
    assert leftovers() == ([], 0), "shutdown left actors or placement groups"


def test_hunyuan_frames_are_the_bytes_of_mp(ray_cluster, tmp_path_factory):
    """HunyuanVideo 1.5 text-to-video at cfg2 (a branch per rank, the halves gathered): Ray's actors give mp's bytes."""
    import test_hunyuan as hv

    model = hv.hunyuan_checkpoint(tmp_path_factory)
    frames = {}
    for executor in ("mp", "ray"):
        with VideoGenerator.from_pretrained(str(model), executor=executor, num_gpus=2, cfg_parallel=True) as gen:
            result = gen.generate(hv.PROMPT, negative_prompt=hv.NEGATIVE, save_video=False, **hv.REQUEST)
            frames[executor] = result.frames
    assert frames["ray"] is not None and frames["ray"].std() > 10
    assert np.array_equal(frames["ray"], frames["mp"])
    assert leftovers() == ([], 0)


def test_nothing_of_a_local_cluster_the_executor_starts_listens_beyond_loopback(loopback_run):
    """In a fresh process with no cluster to find (an empty RAY_TMPDIR, kept short: Ray's socket paths are limited),
    the executor starts its own; every listening socket of it (GCS, raylet, agents, workers, the driver) and of the
    rank actors (Ray's server, gloo) is on 127.0.0.1 or ::1."""
    proc = loopback_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["node"] == "127.0.0.1" and seen["frames"]
    listening = {int(pid): ips for pid, ips in seen["listening"].items()}
    assert all(listening.get(pid) for pid in seen["actors"]), f"every actor listens somewhere: {listening}"
    wide = {pid: ips for pid, ips in listening.items() if not all(is_loopback(ip) for ip in ips)}
    assert wide == {}, f"listening beyond loopback: {wide}"


def _cli(args, timeout=300, env=None):
    env = {**(os.environ if env is None else env), "DISTVIDEO_NO_PROGRESS": "1"}
    cmd = [console_script("distvideo"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def test_batch_and_a_served_job(ray_cluster, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red kite\na blue kite\n")
    out = tmp_path / "batch"
    small = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2"]
    proc = _cli(
        [
            *("generate", "--prompts", str(prompts), "--executor", "ray", "--num-gpus", "2", "--replicas", "2"),
            *("--ray-address", ray_cluster, "--output", str(out), *small),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(list(out.glob("*.mp4"))) == 2
    # two replicas of one rank each, on the driver's node: they meet rank 0 in a private file store
    with start_server(tmp_path / "serve", "ray", args=["--ray-address", ray_cluster, "--replicas", "2"]) as server:
        assert len(server.http.get("/health").json()["replicas"]) == 2
        videos = [server.create(prompt=f"a boat {i}", **SMALL) for i in range(2)]
        assert [server.wait(v["id"])["status"] for v in videos] == ["completed"] * 2
    assert leftovers() == ([], 0)


def test_two_emulated_nodes_order_ranks_by_node_and_serve_two_replicas(two_nodes_run):
    """One rank per emulated node; then a service with one replica on each node: its replicas meet the driver in rank
    0's TCPStore (every node reaches it), not in a file store of the driver's machine, and each runs a job with the
    bytes of one inline rank."""
    proc = two_nodes_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    (node0, local0, count0), (node1, local1, count1) = seen["placed"]
    assert node0 == seen["driver"] and node1 != node0, "one rank per node, the driver's node first"
    assert (local0, count0, local1, count1) == (0, 1, 0, 1)
    assert seen["frames"]
    assert seen["store"][0] == "127.0.0.1" and seen["store"][1] > 0, "emulated nodes: rank 0's store, on loopback"
    assert seen["done"] == ["completed"] * 2, seen
    # both jobs ran; which replica took the second depends on whether the first was still running (it nearly always
    # is), so the count is what holds whatever the timing
    assert len(seen["jobs_done"]) == 2 and sum(seen["jobs_done"]) == 2, seen
    assert seen["private_stores"] == [], "the replicas met in a file store only the driver's machine has"
    assert seen["videos"] == [seen["reference"]] * 2
