"""Shared fixtures and the suite's rules: small random-weight checkpoints built by the repo's own builder (nothing is
downloaded); no test may skip unless it needs a GPU; the local Slurm this session started is stopped at its end."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DISTVIDEO_NO_PROGRESS", "1")

# torch.compile's Inductor compiles its kernels in a pool of worker processes (as many as cores), each importing torch
# first: on a 2-core machine that costs more than it saves (tests/test_compile.py and test_hunyuan_options.py: 29 s
# and 39 CPU-seconds with the pool, 14 s and 16 without). The kernels are the same either way.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# One intra-op thread per rank, in this process and every process it starts, unless the caller set it: a tiny model's
# generation on 2 threads took 0.083 to 0.096 s and 0.165 to 0.190 CPU-seconds, on 1 thread 0.101 to 0.108 s and
# 0.10 CPU-seconds (the second thread mostly spins in libgomp's wait), and the background jobs get the CPU the spinning
# took. Every rank of the suite then runs the same thread count, at which byte identity across executors is promised
# (docs/determinism.md). The tests of the thread policy itself remove the variable (test_external_launch.py's
# THREAD_VARIABLES, test_mp_start.py).
os.environ.setdefault("DISTVIDEO_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent

# The suite's default model is the tiny random-weight one (fast; the recorded frames and the random LoRA files are
# made for it), for this process and every process it starts (launchers, spawned ranks, servers). The trained demo
# model, once it ships as the package's default (docs/demo-model.md), gets its own tests, which name it or unset this.
os.environ["DISTVIDEO_MODEL"] = str(REPO / "src" / "distvideo" / "assets" / "tiny-wan")

# The automatic layout plans with the documented assumptions in every test: a probe file a developer measured on this
# machine (`distvideo plan --probe`, ~/.cache/distvideo/probe.json) would change the layouts the tests expect. A
# test of the probe writes its own file here (tests/test_autolayout_probe.py).
os.environ["DISTVIDEO_PROBE_FILE"] = str(Path("/nonexistent") / "distvideo-suite-probe.json")

# The suite runs on the CPU on every machine, one with GPUs included: its frames, its gloo groups and its exact
# comparisons are CPU ones, and a rank that found a GPU would take it (select_device). Hidden here, before anything
# initialises CUDA, for this process and every process it starts. A test about CUDA is marked `gpu` and starts its
# processes with VISIBLE_GPUS (the machine's own setting, None when it had none).
VISIBLE_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Property tests draw the same examples on every run (hypothesis seeds each test from its name): the suite's verdict
# must not depend on pytest-randomly's seed. A fresh-clone run once drew a config file the property refused (a real
# bug, now tests/test_config.py::test_a_bad_lora_string_in_the_file_names_the_file_and_the_key) on one seed in three.
# To explore new examples, run `HYPOTHESIS_PROFILE=explore pytest tests/test_fuzz.py` and turn what fails into a test.
settings.register_profile("suite", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

ONLY_GPU_MAY_SKIP = (
    "only tests that need hardware this machine cannot have may skip (marked `gpu`, or `onednn` on a CPU oneDNN does "
    "not support); a test the machine cannot run fails instead: install what the reason names (make setup; make "
    "system-deps, as root)"
)
ONEDNN_MACHINES = ("x86_64", "amd64", "aarch64", "arm64")  # CPUs oneDNN supports: every torch build there has it


# --- the skip rule --------------------------------------------------------------------------------------------------
def _may_skip(item: pytest.Item) -> bool:
    import platform

    if item.get_closest_marker("gpu") is not None:
        return True
    return item.get_closest_marker("onednn") is not None and platform.machine().lower() not in ONEDNN_MACHINES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import platform

    machine = platform.machine().lower()
    for item in items:
        if item.get_closest_marker("onednn") and machine not in ONEDNN_MACHINES:
            item.add_marker(pytest.mark.skip(reason=f"needs oneDNN, which does not exist for {machine} CPUs"))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; this machine has none"))


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A skip of a test not marked for missing hardware (a missing launcher, package or tool; an importorskip) is a
    failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and not _may_skip(item):
        report.outcome = "failed"
        report.longrepr = f"skipped: {_skip_reason(report)}\n{ONLY_GPU_MAY_SKIP}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """The same for a whole module skipped while it is collected (a module-level skip or importorskip)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = f"module skipped: {_skip_reason(report)}\n{ONLY_GPU_MAY_SKIP}"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The order's seed, also under -q (which hides pytest-randomly's header line): rerun an order with
    `-p randomly --randomly-seed=N`."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"test order: pytest-randomly seed {seed} (rerun it with --randomly-seed={seed})")
    elif not config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line("test order: the files' order (pytest-randomly is off)")


# --- jobs in the background ---------------------------------------------------------------------------------------
# A test module may name jobs that mostly wait (processes waiting out a timeout): BACKGROUND_JOBS, fixture name ->
# (start, stop). When a collected test uses that fixture, `start` runs as soon as collection ends, so the waiting
# overlaps the rest of the suite instead of holding it up; the fixture then collects the outcomes. `stop` runs at the
# session's end whatever happened (the fixture stops them itself when it is done). A name "fixture[id]" starts its job
# only for a collected test using that fixture whose parameter id has that part (a launcher's job: "launched[mpirun]").
_background_stops: list = []


def _uses_job(item: pytest.Item, key: str) -> bool:
    fixture, _, part = key.partition("[")
    if fixture not in getattr(item, "fixturenames", ()):
        return False
    callspec = getattr(item, "callspec", None)
    return not part or (callspec is not None and part.rstrip("]") in callspec.id.split("-"))


def _claims_a_job(item: pytest.Item) -> bool:
    jobs = getattr(getattr(item, "module", None), "BACKGROUND_JOBS", {})
    return any(_uses_job(item, key) for key in jobs)


class _JobsLast:
    """The modules whose tests collect a background job's outcome run after the others (each part keeps
    pytest-randomly's order, and a module stays whole, so its module fixtures are made once): the jobs then have the
    whole foreground to finish in the gaps it leaves, and a test rarely waits for one still queued or under way (in
    one order the foreground waited 62 s for the shared 2-rank launch and 42 s for the memory-estimate job)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        claiming = {item.nodeid.split("::")[0] for item in items if _claims_a_job(item)}
        items[:] = [i for i in items if i.nodeid.split("::")[0] not in claiming] + [
            i for i in items if i.nodeid.split("::")[0] in claiming
        ]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_JobsLast(), "distvideo-jobs-last")


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    from background import paused

    started = set()
    with paused():  # none begins before all are started: a shared launch (launch_groups.py) must know all its cases
        for item in session.items:
            jobs = getattr(getattr(item, "module", None), "BACKGROUND_JOBS", {})
            for fixture, (start, stop) in jobs.items():
                if start not in started and _uses_job(item, fixture):
                    started.add(start)
                    _background_stops.append(stop)
                    start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for stop in _background_stops:
        stop()
    launchers = sys.modules.get("launchers")
    if launchers is not None:
        launchers.stop_local_slurm()


# --- models ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from distvideo.models.embedded import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def test_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 transformer layers, UniPC scheduler (the real Wan2.1 scheduler config)."""
    from distvideo.testing.checkpoints import build_test_checkpoint

    return build_test_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-wan-4l")


@pytest.fixture
def no_weights_loaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A tripwire: loading model weights in this process fails the test. Replaces distvideo's `load_components` in
    every module that holds it (wherever the engine calls it from), so a request that had to be refused before any
    loading cannot get that far unnoticed. `test_api.py::test_the_load_tripwire_catches_a_load` checks it fires."""
    from distvideo.models import loading

    original = loading.load_components

    def refuse(*args, **kwargs):
        raise AssertionError("model weights were loaded for input that had to be refused before any loading")

    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("distvideo") and getattr(module, "load_components", None) is original:
            monkeypatch.setattr(module, "load_components", refuse)
            patched.append(name)
    assert "distvideo.models.loading" in patched, patched
    yield
    # a module first imported during the test (`from distvideo.models.loading import load_components`) took the
    # tripwire itself, which monkeypatch does not know to undo: put the real function back there too
    for name, module in list(sys.modules.items()):
        if name.startswith("distvideo") and getattr(module, "load_components", None) is refuse:
            module.load_components = original


# --- references and comparisons -------------------------------------------------------------------------------------
def diffusers_pipeline(model: Path):
    """diffusers' own WanPipeline for a checkpoint folder (the reference every parity test compares with)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(model))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_frames(model_or_pipe, prompt: str, **kwargs) -> np.ndarray:  # noqa: F821
    """diffusers' WanPipeline frames as uint8 (output_type='np', times 255, rounded); `model_or_pipe` is a checkpoint
    folder or a pipeline from `diffusers_pipeline` (e.g. with LoRA adapters set)."""
    import numpy as np
    import torch

    pipe = diffusers_pipeline(model_or_pipe) if isinstance(model_or_pipe, (str, Path)) else model_or_pipe
    seed = kwargs.pop("seed", 0)
    out = pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs).frames[0]
    return np.round(out * 255).astype(np.uint8)


def max_abs_diff(a, b) -> int:
    import numpy as np

    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def read_video(path: str | Path):
    """Decoded frames (T, H, W, 3) uint8 of an mp4, and its codec and pixel format."""
    import av
    import numpy as np

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        codec, pix_fmt = stream.codec_context.name, stream.codec_context.pix_fmt
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    return np.stack(frames), codec, pix_fmt


# --- hygiene --------------------------------------------------------------------------------------------------------
def _signal_state() -> tuple[object, object, frozenset[int]]:
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else set()
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), frozenset(mask)


@pytest.fixture(autouse=True)
def _signals_left_as_found():
    """Every test leaves the stop signals' handlers and the main thread's signal mask as it found them: a blocked or
    ignored SIGINT leaks into every process the test run starts afterwards (both survive exec)."""
    before = _signal_state()
    yield
    after = _signal_state()
    assert after == before, f"the test changed the signal state (SIGINT, SIGTERM handlers, mask): {before} -> {after}"
