"""Long runs in one generator (embedded tiny model, inline executor): memory, file descriptors and threads stay level.

200 consecutive generations (5 frames, 32x32, 1 step; one in 50 also writes its video) and 50 LoRA set/clear cycles.
Resident memory after the last must stay within 10% of its level after the 10th (when caches and allocator pools
have grown to their working size); open file descriptors and threads (Python's and the OS's) must not grow at all.
The measured figures are printed ("FIGURE ..." lines, `pytest -s`) for docs/reliability.md.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch

from distvideo import VideoGenerator

from background import paused

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
    """Run step(0..n-1); usage after step BASELINE_AFTER-1 and after the last. No background job runs meanwhile
    (tests/background.py): its threads and pipes would count as this process's."""
    baseline: dict[str, int] = {}
    with paused():
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


@pytest.fixture(scope="module")
def gen(tiny_model: Path) -> Iterator[VideoGenerator]:
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DISTVIDEO_NUM_THREADS", "1")  # steadier on a shared 2-core machine; restored below
        generator = VideoGenerator.from_pretrained(tiny_model, executor="inline")
    try:
        yield generator
    finally:
        generator.shutdown()
        torch.set_num_threads(threads)


def test_200_generations_keep_memory_files_and_threads_level(gen: VideoGenerator, tmp_path: Path):
    written: list[str] = []

    def generate(i: int) -> None:
        save = i % 50 == 5  # the first write (codec set-up) comes before the baseline
        res = gen.generate("a fox in the snow", seed=i, save_video=save, output_path=str(tmp_path), **TINY)
        assert res.frames is not None and res.frames.shape == (5, 32, 32, 3)
        if save:
            assert res.video_path is not None
            written.append(Path(res.video_path).name)

    baseline, end = soak(GENERATIONS, generate)
    check_level(f"{GENERATIONS} generations", baseline, end)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written) and len(written) == GENERATIONS // 50


def test_50_lora_set_and_clear_cycles_keep_memory_files_and_threads_level(gen: VideoGenerator, tmp_path: Path):
    from distvideo.lora.rank import transformer_digest
    from distvideo.testing.lora_files import build_random_lora

    files = [build_random_lora(gen.model_info.path, tmp_path / f"style{k}.safetensors", seed=k) for k in range(2)]
    base = gen.collective_rpc(transformer_digest)

    def cycle(i: int) -> None:
        gen.set_lora_adapter(f"style{i % 2}", files[i % 2] if i < 2 else None, strength=0.5 + (i % 3) / 4)
        gen.clear_lora_adapters()

    baseline, end = soak(LORA_CYCLES, cycle)
    check_level(f"{LORA_CYCLES} LoRA set/clear cycles", baseline, end)
    assert gen.collective_rpc(transformer_digest) == base, "clearing must restore the base weights bit for bit"
