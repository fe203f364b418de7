"""Devices, dtypes, threads and memory figures of one rank: small pure helpers the worker and the bench share."""

from __future__ import annotations

import logging
import resource
import socket

import torch

from distvideo import envs
from distvideo.errors import ConfigError
from distvideo.machine import available_cores

logger = logging.getLogger(__name__)


def default_num_threads(local_world_size: int | None) -> int | None:
    """Intra-op threads for one rank: DISTVIDEO_NUM_THREADS, else the user's OMP_NUM_THREADS, else
    cores / ranks on this node. torchrun sets OMP_NUM_THREADS=1 itself, which is not the user's
    choice, so under torchrun a value of 1 is overridden unless DISTVIDEO_NUM_THREADS says so."""
    explicit = envs.get("DISTVIDEO_NUM_THREADS")
    if explicit:
        return int(explicit)
    omp = envs.get("OMP_NUM_THREADS")
    if omp and not (omp == "1" and envs.is_set("TORCHELASTIC_RUN_ID")):
        # the user's setting, applied explicitly: a worker forked from the mp executor's fork server has the OpenMP
        # runtime the fork server started (it read OMP_NUM_THREADS then), not one that read the driver's value
        first = omp.split(",")[0].strip()  # a nested setting ("4,2"): the outer level
        return int(first) if first.isdigit() and int(first) > 0 else None
    return max(1, available_cores() // max(1, local_world_size or 1))


def cuda_device_index(local_rank: int, visible: int, cuda_visible_devices: str | None = None) -> int:
    """The CUDA device index of the rank with `local_rank` on a node where this process sees `visible` GPUs.

    Pure. Every process sees all of the node's GPUs (torchrun, mpirun, srun without --gpus-per-task): local rank r
    takes cuda:r. Each process sees one GPU (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per rank): cuda:0,
    whatever the local rank. Otherwise there are more ranks on the node than GPUs: a RuntimeError that names
    `cuda_visible_devices` (the variable's value, for the message) and what would work."""
    if visible < 1:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: none visible (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}); "
            "pass device='cpu' or make a GPU visible"
        )
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise RuntimeError(
        f"local rank {local_rank} has no GPU: {visible} visible (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}). "
        f"Launch at most {visible} ranks per node, or bind one GPU per task (srun --gpus-per-task=1, or set "
        "CUDA_VISIBLE_DEVICES per rank)."
    )


def select_device(requested: str | None, local_rank: int) -> torch.device:
    """`requested` when given ("cuda" alone: this local rank's GPU, as below); else the GPU of this local rank (:func:`cuda_device_index`) when CUDA is available;
    else the CPU."""
    if requested:
        return _requested_device(requested, local_rank)
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        index = cuda_device_index(local_rank, count, envs.get_raw("CUDA_VISIBLE_DEVICES"))
        if index != local_rank:
            logger.info("local rank %d sees one GPU (per-task binding); using cuda:0", local_rank)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _requested_device(requested: str, local_rank: int) -> torch.device:
    """A device the caller named: "cuda" without an index is this local rank's GPU (as with no device given); a
    CUDA device this process cannot see is a ConfigError naming `device`, not a failure deep inside torch."""
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device={requested!r}: torch sees no CUDA GPU on host {socket.gethostname()} (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); pass device='cpu' or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if device.index is None:
        return torch.device("cuda", cuda_device_index(local_rank, count, envs.get_raw("CUDA_VISIBLE_DEVICES")))
    if device.index >= count:
        raise ConfigError(
            f"device={requested!r}: this process sees {count} GPU(s), cuda:0 to cuda:{count - 1} "
            f"(CUDA_VISIBLE_DEVICES={envs.get_raw('CUDA_VISIBLE_DEVICES')!r})"
        )
    return device


def component_dtypes(device: torch.device, dtype: str | None) -> dict[str, torch.dtype]:
    """float32 on CPU; on GPUs bfloat16 for the transformers and text encoder and float32 for the VAE
    (Wan's VAE is sensitive to reduced precision) and the CLIP image encoder (as diffusers documents for Wan I2V),
    unless `dtype` says otherwise (the transformers and the text encoder)."""
    if dtype is not None:
        main = getattr(torch, dtype)
    else:
        main = torch.bfloat16 if device.type == "cuda" else torch.float32
    return {
        "transformer": main,
        "transformer_2": main,
        "text_encoder": main,
        "vae": torch.float32,
        "image_encoder": torch.float32,
    }


def reset_peak_memory(device: torch.device) -> str:
    """Start a new peak-memory window; returns the name of the metric :func:`peak_memory_mb` will report."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda max_memory_allocated"
    try:  # Linux >= 4.0: "5" resets the resident-set high-water mark (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "peak RSS of the run (VmHWM after reset)"
    except OSError:
        return "peak RSS of the process lifetime (VmHWM, no reset possible)"


def _status_mb(field: str) -> float | None:
    """A memory field of /proc/self/status (VmHWM, VmRSS) in MiB, or None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since :func:`reset_peak_memory`, in MiB: CUDA max allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = _status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def memory_in_use_mb(device: torch.device) -> float:
    """Memory this process holds now, in MiB, in the unit of :func:`peak_memory_mb`: CUDA memory allocated, or the
    process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return _status_mb("VmRSS") or 0.0


def available_memory_bytes(device: torch.device) -> int:
    """Memory a request can still take: the free memory of a CUDA device, the available RAM of the machine on CPU
    (shared by every rank on it)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)
