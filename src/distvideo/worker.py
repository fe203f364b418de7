"""One rank: its device, its process group, the loaded pipeline; runs requests and named methods.

Executors create exactly one Worker per rank and reach it only through `execute_forward` and
`execute_method` (what `collective_rpc` calls), so every executor drives the same code.
"""

from __future__ import annotations

import gc
import logging
import os
import resource
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from distvideo import envs
from distvideo.config import EngineConfig, GenerationRequest
from distvideo.models.loading import load_components
from distvideo.models.registry import ModelInfo, probe_model

logger = logging.getLogger(__name__)


@dataclass
class RankInfo:
    """Where a worker sits: filled by the executor that creates it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = 1
    init_method: str | None = None  # None: no process group (a single rank)
    output_rank: int = 0


@dataclass
class WorkerOutput:
    rank: int
    frames: np.ndarray | None
    timings: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0


def default_num_threads(local_world_size: int | None) -> int | None:
    """Intra-op threads for one rank: DISTVIDEO_NUM_THREADS, else the user's OMP_NUM_THREADS, else
    cores / ranks on this node. torchrun sets OMP_NUM_THREADS=1 itself, which is not the user's
    choice, so under torchrun a value of 1 is overridden unless DISTVIDEO_NUM_THREADS says so."""
    explicit = envs.get("DISTVIDEO_NUM_THREADS")
    if explicit:
        return int(explicit)
    omp = envs.get("OMP_NUM_THREADS")
    if omp and not (omp == "1" and envs.is_set("TORCHELASTIC_RUN_ID")):
        return None  # the user's setting; torch already honours it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size or 1))


def select_device(requested: str | None, local_rank: int) -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank < count:
            return torch.device("cuda", local_rank)
        if count == 1:
            logger.info("local rank %d sees one GPU (per-task binding); using cuda:0", local_rank)
            return torch.device("cuda", 0)
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: {count} visible (CUDA_VISIBLE_DEVICES="
            f"{envs.get_raw('CUDA_VISIBLE_DEVICES')!r}). Launch at most {count} ranks per node, or bind one GPU "
            "per task (srun --gpus-per-task=1, or set CUDA_VISIBLE_DEVICES per rank)."
        )
    return torch.device("cpu")


def component_dtypes(device: torch.device, dtype: str | None) -> dict[str, torch.dtype]:
    """float32 on CPU; on GPUs bfloat16 for the transformer and text encoder and float32 for the VAE
    (Wan's VAE is sensitive to reduced precision), unless `dtype` says otherwise."""
    if dtype is not None:
        main = getattr(torch, dtype)
    else:
        main = torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"transformer": main, "text_encoder": main, "vae": torch.float32}


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


_process_groups_created = 0  # in this process; every rank creates the same sequence, so the numbers agree


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout: timedelta | None) -> Any:
    """The rendezvous store of `init_method`, seen through a key prefix of its own for each process group this process
    creates. A store can outlive a process group (torchrun's agent hosts it for the whole job), and a second
    VideoGenerator in the same job would otherwise read the first one's keys, such as gloo's peer addresses, and
    try to connect to ports that are closed."""
    global _process_groups_created
    _process_groups_created += 1
    options = {"timeout": timeout} if timeout is not None else {}
    store, _, _ = next(torch.distributed.rendezvous(init_method, rank, world_size, **options))
    return torch.distributed.PrefixStore(f"distvideo/pg{_process_groups_created}/", store)


class Worker:
    def __init__(self, config: EngineConfig, rank_info: RankInfo, *, model_info: ModelInfo | None = None):
        self.config = config
        self.rank_info = rank_info
        self.rank = rank_info.rank
        self.local_rank = rank_info.local_rank
        self.world_size = rank_info.world_size
        self.device = select_device(config.device, rank_info.local_rank)
        self.model_info = model_info
        self.pipeline: Any = None
        self.process_group_initialized = False
        self.cpu_group: Any = None  # gloo group for control messages (the default group on CPU)
        self.parallel: Any = None  # distvideo.parallel.context.ParallelContext when world_size > 1

    @property
    def is_output_rank(self) -> bool:
        return self.rank == self.rank_info.output_rank

    # -- life cycle ------------------------------------------------------------------------------
    def init_device(self) -> None:
        threads = default_num_threads(self.rank_info.local_world_size)
        if threads is not None:
            torch.set_num_threads(threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.rank_info.init_method is not None and not torch.distributed.is_initialized():
            timeout = timedelta(seconds=self.config.dist_timeout) if self.config.dist_timeout else None
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            kwargs: dict[str, Any] = {}
            if self.device.type == "cuda":
                kwargs["device_id"] = self.device
            torch.distributed.init_process_group(
                backend=backend,
                store=rendezvous_store(self.rank_info.init_method, self.rank, self.world_size, timeout),
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
                **kwargs,
            )
            self.process_group_initialized = True
            if backend == "gloo":
                self.cpu_group = torch.distributed.group.WORLD
            else:
                self.cpu_group = torch.distributed.new_group(backend="gloo", timeout=timeout)
        if self.world_size > 1:  # the layout's process groups, once, right after the default group
            from distvideo.parallel.context import ParallelContext

            heads = self.model_info.num_attention_heads if self.model_info is not None else None
            self.parallel = ParallelContext.create(
                self.config,
                world_size=self.world_size,
                num_heads=heads,
                device=self.device,
                timeout=timedelta(seconds=self.config.dist_timeout) if self.config.dist_timeout else None,
            )
        logger.debug("rank %d: device %s, %d threads", self.rank, self.device, torch.get_num_threads())

    def load_model(self) -> None:
        from distvideo.pipelines import PIPELINES

        info = self.model_info or probe_model(str(self.config.model))
        self.model_info = info
        components = load_components(info, component_dtypes(self.device, self.config.dtype))
        if self.parallel is not None:
            self.parallel.apply_plans(components)  # Ulysses on the transformer, banded decode on the VAE
        pipeline_cls = PIPELINES[info.family.pipeline]
        show = self.is_output_rank and not envs.get("DISTVIDEO_NO_PROGRESS")
        self.pipeline = pipeline_cls(components, self.device, show_progress=show, parallel=self.parallel)

    def shutdown(self, *, broken: bool = False) -> None:
        """Release the pipeline and the process groups. `broken`: a collective failed (a peer died, timed out or left),
        so nothing that could wait on a peer may run: gloo groups are freed (a local operation that also closes this
        rank's connections, so peers still waiting on it fail at once instead of at their timeout), NCCL groups are
        aborted rather than destroyed, and any error is logged, not raised."""
        self.pipeline = None
        self.cpu_group = None
        self.parallel = None
        if self.process_group_initialized and torch.distributed.is_initialized():
            if not broken:
                torch.distributed.destroy_process_group()
                logger.debug("rank %d: process group destroyed", self.rank)
            else:
                try:
                    abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
                    if self.device.type == "cuda" and abort is not None:
                        abort()
                    else:
                        torch.distributed.destroy_process_group()
                    gc.collect()  # the groups' last references may sit in reference cycles (modules, hooks)
                    logger.debug("rank %d: broken process group released", self.rank)
                except Exception:
                    logger.debug("releasing a broken process group failed", exc_info=True)
        self.process_group_initialized = False

    # -- calls -----------------------------------------------------------------------------------
    def execute_forward(self, request: GenerationRequest, show_progress: bool | None = None) -> WorkerOutput:
        if self.pipeline is None:
            raise RuntimeError("the worker has no model loaded (was it shut down?)")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if show_progress is not None:
            self.pipeline.show_progress = show_progress and self.is_output_rank
        batch = self.pipeline(request)
        frames = batch.frames if ((self.is_output_rank and request.return_frames) or request.save_video) else None
        if not self.is_output_rank:
            frames = None
        return WorkerOutput(
            rank=self.rank, frames=frames, timings=batch.timings, peak_memory_mb=peak_memory_mb(self.device)
        )

    def execute_method(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Call a Worker method by name, or a callable as fn(worker, *args, **kwargs)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # device selection is per thread
        if callable(method):
            return method(self, *args, **kwargs)
        if not isinstance(method, str) or method.startswith("_"):
            raise ValueError(f"collective_rpc: {method!r} is not a public worker method name or a callable")
        fn = getattr(self, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"collective_rpc: the worker has no method {method!r}")
        return fn(*args, **kwargs)

    def ping(self) -> int:
        return self.rank
