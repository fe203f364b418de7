"""The mp executor: distvideo spawns 2 CPU ranks and drives them from this process.

Rank-ordered results, failures as data, per-call timeouts, frames through shared memory, a worker killed
mid-call, a rank failing at start-up, shutdown, Ctrl-C and the death of the driver. Most tests share one
2-rank generator (starting one costs seconds on a 2-core machine); the ones that kill it start their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import pytest

from distvideo import VideoGenerator
from distvideo.errors import WorkerDiedError
from distvideo.executors.base import RankFailure
from distvideo.models.embedded import tiny_model_path
from distvideo.request import ResolvedRequest
from distvideo.testing.checkpoints import build_embedded_model

from background import foreground_children
from processes import Running, wait_gone

pytestmark = pytest.mark.slow

# The helpers below travel to the workers by value: the workers need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = {"num_frames": 5, "height": 32, "width": 32, "num_inference_steps": 2, "save_video": False}


# --- helpers run on the workers -----------------------------------------------------------------
def rank_of(worker):
    return worker.rank


def pid_of(worker):
    return os.getpid()


def echo(worker, x, *, y):
    return (worker.rank, x, y)


def array_sum(worker, values):
    return int(values.sum())


def boom_on_rank_1(worker):
    if worker.rank == 1:
        raise ValueError("boom")
    return worker.rank


def sleep_then_answer(worker, seconds, answer, started_dir=None):
    """Sleep, then answer; with `started_dir`, first write `started<rank>` there (the call is in flight)."""
    if started_dir is not None:
        Path(started_dir, f"started{worker.rank}").write_text("")
    time.sleep(seconds)
    return answer


def wait_for_file(path: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {within} s"
        time.sleep(0.02)


def raise_in_second_transformer_call_on_rank_1(worker):
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if worker.rank == 1 and len(calls) == 2:
            raise RuntimeError("planted failure in transformer call 2 on rank 1")

    worker.pipeline.transformer.register_forward_hook(hook)


# --- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    try:
        return str(tiny_model_path())
    except FileNotFoundError:  # not generated yet in this checkout: build the same folder
        return str(build_embedded_model(tmp_path_factory.mktemp("model") / "tiny-wan"))


class SharedGenerator:
    """One 2-rank mp generator for the module, started on first use and again if a test shut it down."""

    def __init__(self, model: str):
        self.model = model
        self.gen: VideoGenerator | None = None

    def get(self) -> VideoGenerator:
        if self.gen is None or self.gen._executor is None:
            self.gen = VideoGenerator.from_pretrained(self.model, num_gpus=2, executor="mp")
        return self.gen

    def close(self) -> None:
        if self.gen is not None:
            self.gen.shutdown()


@pytest.fixture(scope="module")
def shared(model_path: str):
    holder = SharedGenerator(model_path)
    yield holder
    holder.close()


@pytest.fixture
def gen(shared: SharedGenerator) -> VideoGenerator:
    return shared.get()


def spawned_children() -> set[int]:
    out = set()
    for child in foreground_children():  # not a background job's (tests/background.py)
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


# --- control plane ------------------------------------------------------------------------------
def test_results_come_back_in_rank_order(gen: VideoGenerator):
    assert gen.world_size == 2 and gen.is_output_rank
    assert gen.collective_rpc(rank_of) == [0, 1]
    assert gen.collective_rpc("ping") == [0, 1]
    assert gen.collective_rpc(lambda w: w.world_size) == [2, 2]
    assert gen.collective_rpc(echo, args=("x",), kwargs={"y": 3}) == [(0, "x", 3), (1, "x", 3)]
    big = np.arange(200_000, dtype=np.int64)  # 1.6 MB: travels through one shared-memory segment
    assert gen.collective_rpc(array_sum, args=(big,)) == [int(big.sum())] * 2
    pids = gen.collective_rpc(pid_of)
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_failure_on_one_rank_is_data_and_the_executor_stays_usable(gen: VideoGenerator):
    with pytest.raises(RuntimeError) as info:
        gen.collective_rpc(boom_on_rank_1)
    text = str(info.value)
    assert "rank 1" in text and "ValueError" in text and "boom" in text
    assert "rank 0" not in text
    assert isinstance(info.value, RankFailure) and set(info.value.failures) == {1}
    assert "boom_on_rank_1" in str(info.value.__cause__)  # the worker's traceback is chained
    with pytest.raises(RuntimeError, match="no method 'nope'"):
        gen.collective_rpc("nope")
    assert gen.collective_rpc(rank_of) == [0, 1]


def test_a_timed_out_call_tears_the_workers_down_instead_of_queueing_the_next(model_path: str):
    """A call past its timeout cannot be interrupted inside the workers; the next call would wait behind it, so the
    workers are torn down and the executor says it is dead (issue 14)."""
    gen = VideoGenerator.from_pretrained(model_path, num_gpus=2, executor="mp")
    pids = gen.collective_rpc(pid_of)
    with pytest.raises(TimeoutError) as info:
        gen.collective_rpc(sleep_then_answer, args=(600.0, "late"), timeout=0.5)
    text = str(info.value)
    assert "rank 0" in text and "rank 1" in text and "torn down" in text
    assert wait_gone(pids, within=15) == []
    with pytest.raises(RuntimeError, match="executor is dead"):
        gen.collective_rpc(rank_of)
    gen.shutdown()


def tensors_of(worker):
    import torch

    return {
        "bf16": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16) + worker.rank,
        "scalar": torch.tensor(worker.rank),
        "array": np.full((300, 300), worker.rank, dtype=np.int16),
    }


def test_arrays_and_tensors_come_back_through_shared_memory_and_one_rank_can_answer_alone(gen: VideoGenerator):
    import torch

    results = gen.collective_rpc(tensors_of)
    for rank, result in enumerate(results):
        assert result["bf16"].dtype == torch.bfloat16 and result["bf16"].shape == (2, 3)
        assert torch.equal(result["bf16"], torch.arange(6.0).reshape(2, 3).to(torch.bfloat16) + rank)
        assert result["scalar"].shape == () and int(result["scalar"]) == rank
        assert result["array"].flags.owndata and np.array_equal(result["array"], np.full((300, 300), rank, np.int16))
    only = gen.collective_rpc(tensors_of, unique_reply_rank=1)
    assert int(only["scalar"]) == 1
    assert gen.collective_rpc(rank_of, unique_reply_rank=0) == 0
    with pytest.raises(ValueError, match="unique_reply_rank=2 is not a rank"):
        gen.collective_rpc(rank_of, unique_reply_rank=2)


def test_frames_match_inline_and_only_the_output_rank_ships_them(gen: VideoGenerator, model_path: str):
    result = gen.generate("a red fox running through snow", seed=3, **SMALL)
    assert result.frames is not None and result.frames.dtype == np.uint8
    assert result.frames.flags.owndata and result.frames.flags.writeable  # the driver's own copy

    with VideoGenerator.from_pretrained(model_path, executor="inline") as inline:
        expected = inline.generate("a red fox running through snow", seed=3, **SMALL).frames
    assert np.array_equal(result.frames, expected)

    assert isinstance(result.request, ResolvedRequest)
    outputs = gen.collective_rpc("execute_forward", args=(result.request,))
    assert [o.rank for o in outputs] == [0, 1]
    assert outputs[0].frames is not None and outputs[1].frames is None
    assert np.array_equal(outputs[0].frames, expected)


def test_the_driver_never_imports_the_model_stack(model_path: str, tmp_path: Path):
    """The driver only holds pipes and the output: unpickling its workers' answers must not import diffusers (the
    first answer used to import it, with torch's compiler stack: 2.5 s inside the first timed call). Nor do the ranks
    import torchao, which diffusers and transformers import with every model where it is installed (0.4 CPU-s a rank;
    models/compat.py defer_torchao), unless a --quantize mode needs it."""
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        from distvideo import VideoGenerator
        if __name__ == "__main__":
            with VideoGenerator.from_pretrained({model_path!r}, num_gpus=2, executor="mp", replicas=2) as gen:
                gen.generate("a fox", num_frames=5, height=32, width=32, num_inference_steps=1, save_video=False)
                gen.generate_batch(["a", "b"], output_dir={str(tmp_path / "out")!r}, num_frames=5, height=32,
                                   width=32, num_inference_steps=1, progress=False)
                print(gen.collective_rpc(lambda worker: "torchao" in sys.modules))
            print(sorted(m for m in sys.modules if m.split(".")[0] in ("diffusers", "transformers")))
        """)
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-2:] == ["[False, False]", "[]"], proc.stdout


# --- failures that end the executor -------------------------------------------------------------
def test_a_killed_worker_is_reported_and_the_executor_is_dead(model_path: str, tmp_path: Path):
    gen = VideoGenerator.from_pretrained(model_path, num_gpus=2, executor="mp")
    pids = gen.collective_rpc(pid_of)

    def kill_rank_1_inside_the_call() -> None:
        wait_for_file(tmp_path / "started1", within=60)
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1_inside_the_call, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        gen.collective_rpc(sleep_then_answer, args=(60.0, "never", str(tmp_path)))
    killer.join()
    assert time.monotonic() - start < 55, "the driver waited for the call to end instead of noticing the death"
    assert "rank 1 died (killed by SIGKILL)" in str(info.value)
    with pytest.raises(RuntimeError, match="executor is dead"):
        gen.collective_rpc(rank_of)
    with pytest.raises(RuntimeError, match="executor is dead"):
        gen.generate("a cat", **SMALL)
    assert wait_gone(pids, within=5) == []
    gen.shutdown()
    gen.shutdown()


def test_a_worker_dying_while_idle_is_noticed_without_a_call(model_path: str, caplog: pytest.LogCaptureFixture):
    """The driver's monitor thread waits on the workers while no call runs: a SIGKILLed worker is logged and the
    other worker torn down within seconds, with no call made; the next call raises the WorkerDiedError."""
    gen = VideoGenerator.from_pretrained(model_path, num_gpus=2, executor="mp")
    pids = gen.collective_rpc(pid_of)
    with caplog.at_level("ERROR", logger="distvideo.executors.mp"):
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone(pids, within=10) == [], "the other worker is still running: nobody watched the idle workers"
        with pytest.raises(WorkerDiedError, match=r"rank 1 died \(killed by SIGKILL\)"):
            gen.check_health()  # reads the state only: no call reached the workers
    assert any("rank 1 died (killed by SIGKILL)" in r.getMessage() for r in caplog.records)
    with pytest.raises(WorkerDiedError, match=r"rank 1 died \(killed by SIGKILL\) between calls; the other"):
        gen.collective_rpc(rank_of)
    with pytest.raises(RuntimeError, match="executor is dead"):
        gen.collective_rpc(rank_of)
    gen.shutdown()


def test_a_rank_failing_alone_mid_generation_does_not_wait_for_dist_timeout(model_path: str):
    """Rank 1 raises in its 2nd transformer call while rank 0 waits for it in the CFG all-gather: the driver gives
    rank 0 a settling time, then tears both down and raises rank 1's error, long before dist_timeout."""
    gen = VideoGenerator.from_pretrained(model_path, num_gpus=2, executor="mp", dist_timeout=300)
    pids = gen.collective_rpc(pid_of)
    gen.collective_rpc(raise_in_second_transformer_call_on_rank_1)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        gen.generate("a cat", guidance_scale=5.0, **SMALL)
    took = time.monotonic() - start
    print(f"FIGURE mp, rank 1 failing alone mid-generation: the driver raised {took:.1f} s after generate began")
    message = str(info.value)
    assert 5.0 <= took < 60, f"raised after {took:.1f} s: {message}"
    assert "rank 1: RuntimeError: planted failure in transformer call 2 on rank 1" in message, message
    assert "rank(s) 0 were still inside the call 5 s later" in message and "create a new one" in message, message
    assert info.value.failures == {1: ("RuntimeError", "planted failure in transformer call 2 on rank 1")}
    with pytest.raises(RuntimeError, match="executor is dead"):
        gen.collective_rpc(rank_of)
    assert wait_gone(pids, within=5) == []
    gen.shutdown()


def test_ctrl_c_delivered_to_another_thread_still_interrupts_a_call(model_path: str, tmp_path: Path):
    """The kernel may hand a process's SIGINT to any thread that does not block it (torch's OpenMP threads, say);
    the main thread, blocked waiting for the workers, must still notice it soon and raise KeyboardInterrupt."""
    gen = VideoGenerator.from_pretrained(model_path, num_gpus=1, executor="mp")
    pids = gen.collective_rpc(pid_of)
    sent_at: list[float] = []

    def interrupt_this_thread_once_the_call_runs() -> None:
        wait_for_file(tmp_path / "started0", within=60)
        sent_at.append(time.monotonic())
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # lands on this thread, not on the main thread

    # Python's own Ctrl-C handler, as in a program started from a terminal (a test run started in the background by
    # a non-interactive shell inherits SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sender = threading.Thread(target=interrupt_this_thread_once_the_call_runs, daemon=True)
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            gen.collective_rpc(sleep_then_answer, args=(60.0, "never", str(tmp_path)))
        took = time.monotonic() - sent_at[0]
        sender.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    # the driver waits in 0.5 s slices; 30 s only catches a driver that waits for the call to end (60 s)
    assert took < 30, f"the interrupt was noticed only {took:.1f} s after it was sent"
    with pytest.raises(RuntimeError, match="executor is dead"):
        gen.collective_rpc(rank_of)
    assert wait_gone(pids, within=5) == []
    gen.shutdown()


def test_a_rank_failing_at_start_up_is_named(model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Fault injection without a test hook in the library: the spawned workers inherit PYTHONPATH, so
    # this sitecustomize patches Worker.init_device in them (this process has already started).
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import os

            _rank = os.environ.get("DISTVIDEO_TEST_FAIL_INIT_RANK")
            if _rank is not None:
                from distvideo import worker as _worker

                _init_device = _worker.Worker.init_device

                def init_device(self):
                    if self.rank == int(_rank):
                        raise RuntimeError(f"injected start-up fault on rank {self.rank}")
                    _init_device(self)

                _worker.Worker.init_device = init_device
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DISTVIDEO_MP_START", "spawn")  # a new interpreter runs the sitecustomize; a fork would not
    monkeypatch.setenv("DISTVIDEO_TEST_FAIL_INIT_RANK", "1")
    before = spawned_children()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        # rank 0 waits in the rendezvous for rank 1; the error must not wait for dist_timeout
        VideoGenerator.from_pretrained(model_path, num_gpus=2, executor="mp", dist_timeout=300)
    assert time.monotonic() - start < 120
    text = str(info.value)
    assert "rank 1: RuntimeError: injected start-up fault on rank 1 (in init_device)" in text
    assert "rank 0: torn down after rank 1 failed" in text
    assert isinstance(info.value, RankFailure) and set(info.value.failures) == {1}
    assert spawned_children() - before == set()


def test_start_up_depends_on_no_port_chosen_in_advance(
    model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Between the moment the driver sets up the rendezvous and the moment the ranks join it (seconds: spawned workers
    import torch first), another process may bind any port that was free: a rendezvous at a port chosen in advance
    (tcp://host:port, checked free by the driver, bound by rank 0 later) would then fail the start. The ranks meet
    through a file in a folder of their own instead, and gloo's connections take ports the system gives them when they
    bind. Each worker records the rendezvous it was handed, right before it joins."""
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import os, pathlib

            _dir = os.environ.get("DISTVIDEO_TEST_RENDEZVOUS_DIR")
            if _dir is not None:
                from distvideo import worker as _worker

                _init_device = _worker.Worker.init_device

                def init_device(self):
                    pathlib.Path(_dir, f"init{self.rank}").write_text(self.rank_info.init_method or "")
                    _init_device(self)

                _worker.Worker.init_device = init_device
            """
        )
    )
    signals = tmp_path / "signals"
    signals.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DISTVIDEO_MP_START", "spawn")  # a new interpreter runs the sitecustomize; a fork would not
    monkeypatch.setenv("DISTVIDEO_TEST_RENDEZVOUS_DIR", str(signals))
    with VideoGenerator.from_pretrained(model_path, num_gpus=2, executor="mp") as gen:
        assert gen.collective_rpc(rank_of) == [0, 1]
    init_methods = [(signals / f"init{rank}").read_text() for rank in (0, 1)]
    assert init_methods[0] == init_methods[1], init_methods
    parsed = urllib.parse.urlparse(init_methods[0])
    assert parsed.scheme == "file" and parsed.port is None, f"the rendezvous names a port: {init_methods[0]}"


def test_shutdown_is_idempotent_and_leaves_no_process(shared: SharedGenerator):
    gen = shared.get()
    pids = gen.collective_rpc(pid_of)
    executor = gen.executor
    gen.shutdown()
    gen.shutdown()
    executor.shutdown()
    assert wait_gone(pids, within=10) == []  # shutdown joined them: they are gone already
    with pytest.raises(RuntimeError, match="shut down"):
        executor.collective_rpc(rank_of)


# --- the driver's own fate ----------------------------------------------------------------------
DRIVER = textwrap.dedent(
    """
    import json, os, pathlib, signal, sys, time

    from distvideo import VideoGenerator

    # Python's Ctrl-C handler, as in a program started from a terminal: a test run started in the background by a
    # non-interactive shell hands its children SIGINT ignored, and Python then installs no handler of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def sleep_long(worker, marker):
        pathlib.Path(marker).write_text("")  # the call is in flight
        time.sleep(120)

    if __name__ == "__main__":  # the spawned workers import this file as a module
        model, mode, world, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
        gen = VideoGenerator.from_pretrained(model, num_gpus=world, executor="mp")
        print(json.dumps(gen.collective_rpc(lambda w: os.getpid())), flush=True)
        if mode == "sleep":
            time.sleep(300)
        try:
            gen.collective_rpc(sleep_long, args=(marker,))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        try:
            gen.collective_rpc("ping")
        except RuntimeError as exc:
            print("after:", exc, flush=True)
    """
)


def start_driver(tmp_path: Path, model_path: str, mode: str, world: int) -> Running:
    """DRIVER in a subprocess of its own session (like a program started from a terminal)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    cmd = [sys.executable, str(script), model_path, mode, str(world), str(tmp_path / "in_flight")]
    return Running(cmd, separate_stderr=True)


def test_workers_end_when_their_driver_is_killed(tmp_path: Path, model_path: str):
    with start_driver(tmp_path, model_path, "sleep", world=2) as driver:
        pids = json.loads(driver.read_line(within=120))
        if os.path.isdir("/proc"):  # the workers do not hold the driver's stdin
            assert [os.readlink(f"/proc/{pid}/fd/0") for pid in pids] == [os.devnull] * 2
        os.kill(driver.proc.pid, signal.SIGKILL)
        driver.proc.wait(10)
        assert wait_gone(pids, within=30) == []


def test_ctrl_c_in_the_driver_tears_the_workers_down(tmp_path: Path, model_path: str):
    with start_driver(tmp_path, model_path, "interrupt", world=1) as driver:  # one rank keeps the test short
        pids = json.loads(driver.read_line(within=120))
        wait_for_file(tmp_path / "in_flight", within=60)  # the sleeping call is in flight
        os.killpg(driver.proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C: driver and workers
        assert driver.read_line(within=30) == "interrupted\n", driver.text()
        assert "executor is dead" in driver.read_line(within=10)
        assert driver.wait(30) == 0, driver.text()
        assert "KeyboardInterrupt" not in "".join(driver.stderr)  # the workers ignore SIGINT: no traceback
        assert wait_gone(pids, within=10) == []
