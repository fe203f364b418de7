"""What the bench measures on every rank (sent through collective_rpc) and around each run: matmul peak FLOP/s,
peak memory, stage timings, and the figures derived from them."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from distvideo.bench.plan import MATMUL_SECONDS, RATIO_FIGURES, STAGES
from distvideo.devices import component_dtypes, peak_memory_mb, reset_peak_memory
from distvideo.request import GenerationRequest

if TYPE_CHECKING:
    import numpy as np

    from distvideo.protocols import GeneratorHandle


def measure_matmul_flops(device: Any, dtype: Any, size: int, seconds: float = MATMUL_SECONDS) -> float:
    """Dense matmul FLOP/s of this process on `device`: the best of five windows of size^3 matmuls filling
    `seconds`, at the current torch thread count."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    gen = torch.Generator("cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device, dtype)
    b = torch.randn(size, size, generator=gen).to(device, dtype)
    c = torch.empty(size, size, device=device, dtype=dtype)
    torch.matmul(a, b, out=c)  # first call: library initialisation
    sync()
    start = time.perf_counter()
    torch.matmul(a, b, out=c)
    sync()
    one = max(time.perf_counter() - start, 1e-9)
    windows = 5
    reps = max(1, int(seconds / windows / one))
    best = 0.0
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        sync()
        best = max(best, 2 * size**3 * reps / (time.perf_counter() - start))
    return best


def default_matmul_size(device: Any) -> int:
    return 8192 if device.type == "cuda" else 1024


def rank_reset_peak_memory(worker: Any) -> str:
    return reset_peak_memory(worker.device)


def rank_peak_memory_mb(worker: Any) -> float:
    return peak_memory_mb(worker.device)


def rank_transformer_dtype(worker: Any) -> Any:
    return component_dtypes(worker.device, worker.config.dtype)["transformer"]


def rank_matmul_flops(worker: Any, size: int | None) -> float:
    return measure_matmul_flops(
        worker.device, rank_transformer_dtype(worker), size or default_matmul_size(worker.device)
    )


def rank_environment(worker: Any) -> dict[str, Any]:
    import torch

    dtypes = component_dtypes(worker.device, worker.config.dtype)
    return {
        "rank": worker.rank,
        "device": str(worker.device),
        "device_name": device_name(worker.device),
        "threads": torch.get_num_threads(),
        "dtypes": {name: str(dtype).removeprefix("torch.") for name, dtype in dtypes.items()},
    }


def device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def distvideo_run(gen: GeneratorHandle, request: GenerationRequest) -> tuple[dict[str, Any], np.ndarray | None]:
    """One measured distvideo request on every rank: e2e wall time, stage timings, peak memory of every rank."""
    metrics = gen.collective_rpc(rank_reset_peak_memory)
    start = time.perf_counter()
    result = gen.generate_request(request)
    e2e = time.perf_counter() - start
    peaks = gen.collective_rpc(rank_peak_memory_mb)
    t = result.timings
    record = {
        "e2e_s": e2e,
        "stages": {
            "text_encoding": t["text_encoding"],
            "denoising": t["denoising"],
            "denoising_per_step": t["per_step_denoising"],
            "decoding": t["decoding"],
        },
        "peak_memory_mb": max(peaks),
        "peak_memory_mb_per_rank": peaks,
        "memory_metric": metrics[0],
        "cache": result.cache,  # the step cache's skipped steps (None when off)
    }
    if "compile" in t:  # --compile: seconds torch.compile spent in this request (not in denoising_per_step)
        record["compile_s"] = t["compile"]
    return record, result.frames


def add_efficiency(record: dict[str, Any], model_flops: int, peak_flops: float) -> None:
    """Achieved transformer FLOP/s over the denoising stage, and MFU against the measured matmul peak."""
    achieved = model_flops / record["stages"]["denoising"]
    record["achieved_flops"] = achieved
    record["mfu"] = achieved / peak_flops


def figure(record: Mapping[str, Any], name: str) -> float:
    return float(record["stages"][name] if name in STAGES else record[name])


def median_record(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "e2e_s": statistics.median(r["e2e_s"] for r in records),
        "stages": {s: statistics.median(r["stages"][s] for r in records) for s in STAGES},
        "peak_memory_mb": statistics.median(r["peak_memory_mb"] for r in records),
    }
    for key in ("achieved_flops", "mfu"):
        if all(key in r for r in records):
            out[key] = statistics.median(r[key] for r in records)
    if records and records[-1].get("cache") is not None:
        out["cache"] = records[-1]["cache"]  # the same steps every run: the decision depends on the request only
    if all("peak_memory_mb_per_rank" in r for r in records):
        ranks = len(records[0]["peak_memory_mb_per_rank"])
        out["peak_memory_mb_per_rank"] = [
            statistics.median(r["peak_memory_mb_per_rank"][i] for r in records) for i in range(ranks)
        ]
    return out


def run_ratios(ours: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, float]:
    return {name: figure(ours, name) / figure(reference, name) for name in RATIO_FIGURES}


def max_abs_diff(a: Any, b: Any) -> int:
    import numpy as np

    if a.shape != b.shape:
        raise RuntimeError(f"distvideo and diffusers made frames of different shapes: {a.shape} vs {b.shape}")
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
