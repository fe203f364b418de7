"""Long runs in one generator (embedded tiny model, inline executor): memory, file descriptors and threads stay level.

200 consecutive generations (5 frames, 32x32, 1 step; one in 50 also writes its video) and 50 LoRA set/clear cycles.
Resident memory after the last must stay within 10% of its level after the 10th (when caches and allocator pools
have grown to their working size); open file descriptors and threads (Python's and the OS's) must not grow at all.
The measured figures are printed ("FIGURE ..." lines, `pytest -s`) for docs/reliability.md. Both run in one process of
their own, in the background (tests/background.py): this process's threads and descriptors would count the
background jobs' too.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from distvideo import VideoGenerator

from background import FolderJob, in_a_process

pytestmark = pytest.mark.slow

GENERATIONS = 200
LORA_CYCLES = 50
BASELINE_AFTER = 10
TINY = dict(num_frames=5, height=32, width=32, num_inference_steps=1, max_sequence_length=16)


def usage() -> dict[str, int]:
    gc.collect()
    me = psutil.Process()
    return {
        "rss": me.memory_info().rss,
        "fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else me.num_fds(),
        "python_threads": threading.active_count(),
        "os_threads": me.num_threads(),
    }


def soak(n: int, step: Callable[[int], None]) -> tuple[dict[str, int], dict[str, int]]:
    """Run step(0..n-1); usage after step BASELINE_AFTER-1 and after the last."""
    baseline: dict[str, int] = {}
    for i in range(n):
        step(i)
        if i == BASELINE_AFTER - 1:
            baseline = usage()
    return baseline, usage()


def check_level(what: str, baseline: dict[str, int], end: dict[str, int]) -> None:
    growth = end["rss"] / baseline["rss"] - 1
    print(
        f"FIGURE {what}: RSS {baseline['rss'] / 2**20:.0f} MiB after {BASELINE_AFTER} -> {end['rss'] / 2**20:.0f} MiB "
        f"at the end ({growth:+.1%}); fds {baseline['fds']} -> {end['fds']}; Python threads "
        f"{baseline['python_threads']} -> {end['python_threads']}; OS threads {baseline['os_threads']} -> "
        f"{end['os_threads']}",
        flush=True,
    )
    assert growth <= 0.10, f"{what}: resident memory grew {growth:.1%} (baseline {baseline}, end {end})"
    for key in ("fds", "python_threads", "os_threads"):
        assert end[key] <= baseline[key], f"{what}: {key} grew from {baseline[key]} to {end[key]}"


def run_soaks(folder: Path) -> None:
    """Both soaks in one generator of this process (a process of its own, `_soaks`); writes FOLDER/report.json."""
    from distvideo.lora.rank import transformer_digest
    from distvideo.testing.lora_files import build_random_lora

    os.environ["DISTVIDEO_NUM_THREADS"] = "1"  # steadier on a shared 2-core machine (this process is the soak's own)
    report: dict[str, dict] = {}
    videos = folder / "videos"
    videos.mkdir()
    with VideoGenerator.from_pretrained(executor="inline") as gen:
        written: list[str] = []

        def generate(i: int) -> None:
            save = i % 50 == 5  # the first write (codec set-up) comes before the baseline
            res = gen.generate("a fox in the snow", seed=i, save_video=save, output_path=str(videos), **TINY)
            assert res.frames is not None and res.frames.shape == (5, 32, 32, 3)
            if save:
                assert res.video_path is not None
                written.append(Path(res.video_path).name)

        baseline, end = soak(GENERATIONS, generate)
        report["generations"] = {"baseline": baseline, "end": end, "written": written}

        files = [build_random_lora(gen.model_info.path, folder / f"style{k}.safetensors", seed=k) for k in range(2)]
        base = gen.collective_rpc(transformer_digest)

        def cycle(i: int) -> None:
            gen.set_lora_adapter(f"style{i % 2}", files[i % 2] if i < 2 else None, strength=0.5 + (i % 3) / 4)
            gen.clear_lora_adapters()

        baseline, end = soak(LORA_CYCLES, cycle)
        restored = gen.collective_rpc(transformer_digest) == base
        report["lora"] = {"baseline": baseline, "end": end, "restored": restored}
    (folder / "report.json").write_text(json.dumps(report))


# a process whose figures are all the tests check, its threads and descriptors the generator's alone (whatever this
# process, pytest with the background jobs' pipes and threads, holds meanwhile): in the background (background.py)
SOAKS = FolderJob("the soaks: 200 generations, 50 LoRA cycles", "soak", in_a_process("test_soak", "run_soaks"))
BACKGROUND_JOBS = {"soaked": SOAKS.hooks}


@pytest.fixture
def soaked() -> tuple[Path, dict[str, dict]]:
    folder, proc = SOAKS.result()
    assert proc.returncode == 0, proc.stderr
    return folder, json.loads((folder / "report.json").read_text())


def test_200_generations_keep_memory_files_and_threads_level(soaked):
    folder, report = soaked
    run = report["generations"]
    check_level(f"{GENERATIONS} generations", run["baseline"], run["end"])
    written = run["written"]
    assert (
        sorted(p.name for p in (folder / "videos").iterdir()) == sorted(written) and len(written) == GENERATIONS // 50
    )


def test_50_lora_set_and_clear_cycles_keep_memory_files_and_threads_level(soaked):
    _, report = soaked
    run = report["lora"]
    check_level(f"{LORA_CYCLES} LoRA set/clear cycles", run["baseline"], run["end"])
    assert run["restored"], "clearing must restore the base weights bit for bit"
