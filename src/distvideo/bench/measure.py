"""What the bench measures on every rank (sent through collective_rpc) and around each run: matmul peak FLOP/s,
peak memory, stage timings, and the figures derived from them."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from distvideo.bench.plan import MATMUL_SECONDS, RATIO_FIGURES, STAGES
from distvideo.devices import component_dtypes, memory_in_use_mb, peak_memory_mb, reset_peak_memory
from distvideo.request import ResolvedRequest

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


def rank_peak_memory_mb(worker: Any) -> float:
    return peak_memory_mb(worker.device)


def rank_weights_mb(worker: Any) -> float:
    """MiB of parameters and buffers this rank holds on its device between requests: of every module of its pipeline
    (transformers, text and image encoders, VAE), under sharded weights only its shards (a DTensor's local tensor),
    under --offload only what stays on the device."""
    import torch

    from distvideo.models.quantize import tensor_bytes

    seen: set[int] = set()
    total = 0
    modules = [m for m in vars(worker.pipeline).values() if isinstance(m, torch.nn.Module)]
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) in seen:  # tied weights, a module shared by two pipeline attributes
                continue
            seen.add(id(tensor))
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local.device.type == worker.device.type:
                total += tensor_bytes(local)  # a quantized weight: its int8 or float8 data and its scales
    return total / 2**20


def rank_memory_start(worker: Any) -> dict[str, Any]:
    """Before a measured run: start a new peak window (its metric's name), and what the rank holds now (its weights,
    and all the memory in use in the peak's unit), so that the run's peak can be given above the loaded rank."""
    metric = reset_peak_memory(worker.device)
    return {"metric": metric, "weights_mb": rank_weights_mb(worker), "in_use_mb": memory_in_use_mb(worker.device)}


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


#: the figures a run records for every rank (medians per rank over the runs)
PER_RANK = ("peak_memory_mb_per_rank", "weights_mb_per_rank", "peak_above_loaded_mb_per_rank")


def distvideo_run(gen: GeneratorHandle, request: ResolvedRequest) -> tuple[dict[str, Any], np.ndarray | None]:
    """One measured distvideo request on every rank: e2e wall time, stage timings, and per rank the peak memory, the
    weights held and the peak above the loaded rank (the peak minus the memory in use before the run)."""
    starts = gen.collective_rpc(rank_memory_start)
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
        "weights_mb_per_rank": [st["weights_mb"] for st in starts],
        "peak_above_loaded_mb_per_rank": [peak - st["in_use_mb"] for peak, st in zip(peaks, starts, strict=True)],
        "memory_metric": starts[0]["metric"],
        "cache": result.cache,  # the step cache's skipped steps (None when off)
        "weights": result.weights,  # per transformer and text encoder: the quantization mode, its layers, its bytes
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
    if records and records[-1].get("weights"):
        out["weights"] = records[-1]["weights"]  # as loaded: the same every run
    for key in PER_RANK:
        if records and all(key in r for r in records):
            ranks = len(records[0][key])
            out[key] = [statistics.median(r[key][i] for r in records) for i in range(ranks)]
    return out


def run_ratios(ours: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, float]:
    return {name: figure(ours, name) / figure(reference, name) for name in RATIO_FIGURES}


def max_abs_diff(a: Any, b: Any) -> int:
    import numpy as np

    if a.shape != b.shape:
        raise RuntimeError(f"distvideo and diffusers made frames of different shapes: {a.shape} vs {b.shape}")
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
