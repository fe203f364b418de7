"""One rank: its device, its process group, the loaded pipeline; runs requests and named methods.

Executors create exactly one Worker per rank and reach it only through `execute_forward` and
`execute_method` (what `collective_rpc` calls), so every executor drives the same code.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from distvideo.config import GenerationRequest
from distvideo.devices import component_dtypes, default_num_threads, peak_memory_mb, reset_peak_memory, select_device
from distvideo.engine import ResolvedEngine
from distvideo.launch import LaunchEnv
from distvideo.models import compat
from distvideo.models.loading import load_components
from distvideo.models.plans import apply_plans, speed_plans
from distvideo.parallel.collectives import collective

if TYPE_CHECKING:
    from distvideo.lora.layers import LoraState
    from distvideo.parallel.context import ParallelContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """Where a worker sits: filled by the executor that creates it, through one of the constructors."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = 1
    init_method: str | None = None  # None: no process group (a single rank)
    output_rank: int = 0

    @classmethod
    def single(cls) -> RankInfo:
        """The only rank, in this process (the inline executor)."""
        return cls()

    @classmethod
    def spawned(cls, rank: int, world_size: int, init_method: str) -> RankInfo:
        """A rank the mp executor spawned on this machine (all ranks on one node)."""
        return cls(rank, rank, world_size, world_size, init_method)

    @classmethod
    def launched(cls, env: LaunchEnv) -> RankInfo:
        """A rank a launcher started (torchrun, srun, mpirun): the env:// rendezvous of its variables."""
        return cls(env.rank, env.local_rank, env.world_size, env.local_world_size, "env://")


@dataclass
class WorkerOutput:
    rank: int
    frames: np.ndarray | None
    timings: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0


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
    def __init__(self, engine: ResolvedEngine, rank_info: RankInfo):
        self.engine = engine
        self.config = engine.config
        self.model_info = engine.model
        self.rank_info = rank_info
        self.rank = rank_info.rank
        self.local_rank = rank_info.local_rank
        self.world_size = rank_info.world_size
        self.device = select_device(engine.config.device, rank_info.local_rank)
        self.pipeline: Any = None
        self.process_group_initialized = False
        self.cpu_group: Any = None  # gloo group for control messages (the default group on CPU)
        self.parallel: ParallelContext | None = None  # when world_size > 1
        self.lora: dict[str, LoraState] = {}  # this rank's adapters per transformer (distvideo.lora.rank)
        self._undo_plans: Callable[[], None] | None = None

    @property
    def is_output_rank(self) -> bool:
        return self.rank == self.rank_info.output_rank

    @property
    def timeout(self) -> timedelta | None:
        return timedelta(seconds=self.config.dist_timeout) if self.config.dist_timeout else None

    # -- life cycle ------------------------------------------------------------------------------
    def init_device(self) -> None:
        threads = default_num_threads(self.rank_info.local_world_size)
        if threads is not None:
            torch.set_num_threads(threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.rank_info.init_method is not None and not torch.distributed.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            kwargs: dict[str, Any] = {"device_id": self.device} if self.device.type == "cuda" else {}
            with collective("joining the process group"):
                torch.distributed.init_process_group(
                    backend=backend,
                    store=rendezvous_store(self.rank_info.init_method, self.rank, self.world_size, self.timeout),
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=self.timeout,
                    **kwargs,
                )
                self.process_group_initialized = True
                if backend == "gloo":
                    self.cpu_group = torch.distributed.group.WORLD
                else:
                    self.cpu_group = torch.distributed.new_group(backend="gloo", timeout=self.timeout)
        if self.world_size > 1:  # the layout's process groups, once, right after the default group
            from distvideo.parallel.context import ParallelContext

            self.parallel = ParallelContext.create(self.engine.layout, device=self.device, timeout=self.timeout)
        logger.debug("rank %d: device %s, %d threads", self.rank, self.device, torch.get_num_threads())

    def load_model(self) -> None:
        """Load the components, apply every plan (the one place modules are changed), build the pipeline."""
        from distvideo.pipelines import PIPELINES

        model = self.model_info
        components = load_components(model, component_dtypes(self.device, self.config.dtype))
        transformers = model.family.transformers
        plans = [
            *(self.parallel.plans(transformers) if self.parallel is not None else []),
            *speed_plans(self.config, model),
        ]
        self._undo_plans = apply_plans(components, plans)
        pipeline_cls = PIPELINES[model.family.pipeline]
        self.pipeline = pipeline_cls(
            components,
            self.device,
            model,
            show_progress=bool(self.config.progress) and self.is_output_rank,
            parallel=self.parallel,
        )

    def shutdown(self, *, broken: bool = False) -> None:
        """Release the pipeline and the process groups. `broken`: a collective failed (a peer died, timed out or left),
        so nothing that could wait on a peer may run: gloo groups are freed (a local operation that also closes this
        rank's connections, so peers still waiting on it fail at once instead of at their timeout), NCCL groups are
        aborted rather than destroyed, and any error is logged, not raised."""
        self.pipeline = None
        self.cpu_group = None
        self.parallel = None
        self.lora = {}
        self._undo_plans = None
        if self.process_group_initialized and torch.distributed.is_initialized():
            if not broken:
                torch.distributed.destroy_process_group()
                logger.debug("rank %d: process group destroyed", self.rank)
            else:
                try:
                    abort = compat.abort_process_group()
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
    def execute_forward(self, request: GenerationRequest) -> WorkerOutput:
        if self.pipeline is None:
            raise RuntimeError("the worker has no model loaded (was it shut down?)")
        reset_peak_memory(self.device)
        batch = self.pipeline(request)
        keep = self.is_output_rank and (request.return_frames or request.save_video)
        return WorkerOutput(
            rank=self.rank,
            frames=batch.frames if keep else None,
            timings=batch.timings,
            peak_memory_mb=peak_memory_mb(self.device),
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
