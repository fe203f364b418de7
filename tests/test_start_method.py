"""Which start method the mp executor's workers get (executors/mp_start.py): the fork server on CPU, spawning when
the ranks will use CUDA (a CUDA build of torch can initialize the driver in the fork server while it imports the
libraries, and a process forked after that cannot use the GPU: seen on an H200, docs/BENCHMARKS.md), and whether a
machine counts as a CUDA one when no device is named (parallel/planner.py's `device_kind`, which the automatic layout
uses too): not when CUDA_VISIBLE_DEVICES hides every GPU, as the test suite does on a GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from distvideo.config import EngineConfig
from distvideo.executors import mp_procs, mp_start, resolve_engine
from distvideo.models.embedded import tiny_model_path
from distvideo.parallel import planner


def test_workers_that_will_use_cuda_are_spawned(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("DISTVIDEO_MP_START", raising=False)
    assert mp_start.context().get_start_method() == "forkserver"
    assert mp_start.context(cuda=True).get_start_method() == "spawn"


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("device", "cuda"), [("cuda:0", True), ("cpu", False)])
def test_the_mp_executor_asks_for_its_ranks_device(monkeypatch: pytest.MonkeyPatch, device: str, cuda: bool):
    seen: list[bool] = []

    def context(cuda: bool = False) -> None:
        seen.append(cuda)
        raise _Stop  # before any process starts

    monkeypatch.setattr(mp_start, "context", context)
    engine = resolve_engine(EngineConfig(model=str(tiny_model_path()), executor="mp", num_gpus=1, device=device))
    with pytest.raises(_Stop):
        mp_procs.WorkerProcesses(engine).spawn()
    assert seen == [cuda]


@pytest.mark.parametrize(
    ("visible", "gpus", "kind"),
    [(None, 1, "cuda"), ("0", 1, "cuda"), ("", 1, "cpu"), ("-1", 1, "cpu"), (None, 0, "cpu")],
)
def test_device_kind_sees_the_gpus_that_are_visible(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, visible: str | None, gpus: int, kind: str
):
    driver = tmp_path / "gpus"
    driver.mkdir()
    for i in range(gpus):
        (driver / f"0000:0{i}:00.0").mkdir()
    real = planner.Path
    monkeypatch.setattr(planner, "Path", lambda p: driver if p == "/proc/driver/nvidia/gpus" else real(p))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert planner.device_kind(None) == kind
    assert planner.device_kind("cuda:1") == "cuda" and planner.device_kind("cpu") == "cpu"  # a named device wins
