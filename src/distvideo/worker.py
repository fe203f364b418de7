"""One rank: its device, its process group, the loaded pipeline; runs requests and named methods.

Executors create exactly one Worker per rank and reach it only through `execute_forward` and
`execute_method` (what `collective_rpc` calls), so every executor drives the same code.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from distvideo.devices import (
    available_memory_bytes,
    component_dtypes,
    default_num_threads,
    peak_memory_mb,
    reset_peak_memory,
    select_device,
)
from distvideo.engine import ResolvedEngine
from distvideo.errors import ConfigError, GenerationCancelled
from distvideo.launch import LaunchEnv
from distvideo.models import compat
from distvideo.models.family import ModelFamily, declared
from distvideo.models.loading import load_components
from distvideo.models.memory import USABLE_FRACTION, estimate_request, fitting_size
from distvideo.models.plans import AppliedPlans, apply_plans, speed_plans
from distvideo.models.quantize import DeviceKind, check_support, quantize_components, set_attention_backend
from distvideo.outputs import ItemOutcome, WorkerOutput
from distvideo.parallel.collectives import collective
from distvideo.parallel.shard import gathered_bytes
from distvideo.parallel.vae import decode_band_count
from distvideo.pipelines.base import DenoisingPipeline, Pipeline, record_per_step_denoising
from distvideo.pipelines.control import StepControl
from distvideo.request import ResolvedRequest

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


#: errors every rank of a replica raises together for one item (decided collectively): the item fails, the batch goes
#: on. Anything else ends the batch (a rank alone in trouble leaves its replica's collectives hanging).
ITEM_FAILURES = (ConfigError, GenerationCancelled)


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


def pipeline_class(family: ModelFamily) -> type[DenoisingPipeline]:
    """The pipeline class a family names ("module:Class", in its own package under distvideo/families/)."""
    cls = declared(family.pipeline)
    if not (isinstance(cls, type) and issubclass(cls, DenoisingPipeline)):
        raise TypeError(f"{family.name}: {family.pipeline} is not a pipelines.base.DenoisingPipeline")
    return cls


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
        self.pipeline: Pipeline | None = None
        self.process_group_initialized = False
        self.cpu_group: Any = None  # gloo group for control messages (the default group on CPU)
        self.parallel: ParallelContext | None = None  # when world_size > 1
        self.lora: dict[str, LoraState] = {}  # this rank's adapters per transformer (distvideo.lora.rank)
        self._undo_plans: AppliedPlans | None = None  # calling it removes the plans load_model applied
        self._gathered_bytes = 0  # under sharded weights: full parameters held while the transformer runs
        #: the transformers' and text encoders' weights on this rank: {component: {"mode", "quantized_modules",
        #: "bytes"}} (models/quantize.py)
        self.weights: dict[str, dict[str, Any]] = {}

    @property
    def is_output_rank(self) -> bool:
        """Whether this rank holds its replica's frames (with one replica: the world's output rank)."""
        return self.engine.layout.replica_rank(self.rank) == 0

    @property
    def replica(self) -> int:
        return self.engine.layout.replica(self.rank)

    @property
    def replica_group(self) -> Any:
        """The CPU group of the ranks that run a request together: this rank's replica (None: a single rank)."""
        if self.parallel is None or self.engine.layout.replica_size == 1:
            return None
        return self.parallel.replica_group

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
                # World-wide on purpose, so no mesh dimension: the external executor's status exchange after every
                # call reaches every rank of every replica. On CPU the default group is gloo already.
                if backend == "gloo":
                    self.cpu_group = torch.distributed.group.WORLD
                else:
                    self.cpu_group = torch.distributed.new_group(backend="gloo", timeout=self.timeout)
        if self.world_size > 1:  # the layout's device mesh and its groups, once, right after the default group
            from distvideo.parallel.context import ParallelContext

            self.parallel = ParallelContext.create(self.engine.layout, device=self.device, timeout=self.timeout)
        logger.debug("rank %d: device %s, %d threads", self.rank, self.device, torch.get_num_threads())

    def load_model(self) -> None:
        """Load the components, apply every plan (the one place modules are changed), build the pipeline."""
        from distvideo.pipelines.caching import cache_plans

        model = self.model_info
        pipeline = pipeline_class(model.family)  # its package's modules: the pipeline and its parallel declarations
        ringed = dataclasses.replace(self.config, ring_size=self.engine.layout.ring_size)
        check_support(ringed, DeviceKind.of(self.device))  # a Ray driver may not see the ranks' devices
        dtypes = component_dtypes(self.device, self.config.dtype)
        components = load_components(model, dtypes, allow_pickle_weights=bool(self.config.allow_pickle_weights))
        transformers = model.family.transformers
        # first: the plans wrap the layers as quantized, and Ulysses keeps the attention backend it finds
        self.weights = quantize_components(components, model.family, self.config, dtypes)
        set_attention_backend(components, transformers, self.config.attention or "sdpa")
        plans = [
            *(self.parallel.plans(transformers, pipeline.parallel_points) if self.parallel is not None else []),
            *speed_plans(self.config, model, sp_size=self.engine.layout.sp_size),
        ]
        plans += cache_plans(model.family, compiled=any(plan.name == "compile" for plan in plans))
        if self.parallel is not None:  # last: FSDP wraps the blocks as the other plans left them
            plans += self.parallel.shard_plans(self.config.shard_weights or "none", components, transformers)
        self._undo_plans = apply_plans(components, plans)
        self._gathered_bytes = max(gathered_bytes(components[name]) for name in transformers)
        self.pipeline = pipeline(
            components,
            self.device,
            model,
            show_progress=bool(self.config.progress) and self.is_output_rank,
            parallel=self.parallel,
            offload=self.config.offload or "none",
            offload_experts=self.config.offload_experts,
        )
        if self.pipeline.offload.offloaded and self.rank == 0:
            logger.info("%s", self.pipeline.offload.describe())

    def applied_plans(self) -> dict[str, list[str]]:
        """{component: the names of the plans on it, in the order applied} (collective_rpc("applied_plans"))."""
        return self._undo_plans.names() if self._undo_plans is not None else {}

    def shutdown(self, *, broken: bool = False) -> None:
        """Release the pipeline and the process groups; when it returns, every group this worker created is destructed
        and its threads are joined. `broken`: a collective failed (a peer died, timed out or left), so nothing that
        could wait on a peer may run: gloo groups are freed (a local operation that also closes this rank's
        connections, so peers still waiting on it fail at once instead of at their timeout), NCCL groups are aborted
        rather than destroyed, and any error is logged, not raised.

        Why the groups must be gone here, not merely unregistered: a gloo group's worker thread can still hold the last
        collective's work after the call returned on this thread, and freeing that work's tensors takes the GIL. A
        group that outlives shutdown (the plans' patched forwards and hooks close over the parallel context in
        reference cycles, so only the cyclic garbage collector frees it: on the CLI's way out, the collection inside
        interpreter finalization) keeps its threads running into finalization, where CPython ends any thread that asks
        for the GIL (pthread_exit); the unwind through torch's noexcept decref calls std::terminate, and a rank whose
        video was written aborts ("terminate called without an active exception", exit -6; issue 26). A group's
        destructor joins its threads, each first dropping its work, while the interpreter is still whole."""
        undo, self._undo_plans = self._undo_plans, None
        if undo is not None:
            try:
                undo()  # the modules as loaded: no hook or patched forward refers to the parallel context any more
            except Exception:
                logger.warning("rank %d: undoing the plans at shutdown failed", self.rank, exc_info=True)
        self.pipeline = None
        self.cpu_group = None
        self.parallel = None
        self.lora = {}
        if self.process_group_initialized and torch.distributed.is_initialized():
            if not broken:
                torch.distributed.destroy_process_group()
                gc.collect()  # a group in any other reference cycle (none known once the plans are undone): now, not at exit
                logger.debug("rank %d: process group destroyed", self.rank)
            else:
                try:
                    abort = compat.abort_process_group()
                    if self.device.type == "cuda" and abort is not None:
                        abort()
                    else:
                        torch.distributed.destroy_process_group()
                    gc.collect()  # as above; here it also closes this rank's connections, releasing waiting peers
                    logger.debug("rank %d: broken process group released", self.rank)
                except Exception:
                    logger.debug("releasing a broken process group failed", exc_info=True)
        self.process_group_initialized = False

    # -- calls -----------------------------------------------------------------------------------
    def execute_forward(
        self,
        request: ResolvedRequest,
        *,
        emit: Callable[[tuple[int, int]], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> WorkerOutput:
        """Run one request. After every denoising step `emit((done, total))` is called (the executor's event of the
        step), and the request stops on every rank alike when it passed its request_timeout or `cancelled()` says
        so on any rank."""
        if self.replica != 0:  # a single request runs on the first replica; batches give every replica its share
            return WorkerOutput(rank=self.rank, frames=None)
        on_progress = None if emit is None else lambda done, total: emit((done, total))
        return self._forward(request, on_progress=on_progress, cancelled=cancelled)

    def _forward(
        self,
        request: ResolvedRequest,
        *,
        on_progress: Callable[[int, int], None] | None,
        cancelled: Callable[[], bool] | None,
    ) -> WorkerOutput:
        pipeline = self.pipeline
        if pipeline is None:
            raise RuntimeError("the worker has no model loaded (was it shut down?)")
        self._refuse_if_it_cannot_fit(pipeline, request)
        reset_peak_memory(self.device)
        control = StepControl(
            timeout=request.request_timeout,
            cancelled=cancelled,
            on_progress=on_progress,
            group=self.replica_group,
        )
        compiled_before = compat.compile_seconds() if self.config.compile else 0.0
        batch = pipeline(request, control)
        if self.config.compile:
            steps = len(batch.timesteps) if batch.timesteps is not None else 1
            separate_compile_time(batch.timings, compat.compile_seconds() - compiled_before, steps)
        keep = self.is_output_rank and (request.return_frames or request.save_video)
        return WorkerOutput(
            rank=self.rank,
            frames=batch.frames if keep else None,
            timings=batch.timings,
            peak_memory_mb=peak_memory_mb(self.device),
            cache=batch.cache,
            weights=self.weights,
        )

    def execute_batch(
        self,
        shares: list[list[tuple[int, ResolvedRequest]]],
        *,
        emit: Callable[[ItemOutcome], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> int:
        """Run this rank's replica's share of a batch, in order; its output rank emits each item's ItemOutcome (the
        executor's event of the item) after it. Returns how many items this replica ran."""
        share = shares[self.replica] if self.replica < len(shares) else []
        for index, request in share:
            try:
                output = self._forward(request, on_progress=None, cancelled=cancelled)
                outcome = ItemOutcome(index=index, replica=self.replica, output=output)
            except ITEM_FAILURES as exc:
                outcome = ItemOutcome(index, self.replica, error_type=type(exc).__name__, error=str(exc))
            if self.is_output_rank and emit is not None:
                emit(outcome)
        return len(share)

    def _refuse_if_it_cannot_fit(self, pipeline: Pipeline, request: ResolvedRequest) -> None:
        """ConfigError before any work when the request's activations would not fit this rank's memory (every rank
        on a CPU node shares the machine's RAM). The ranks decide together: where one refuses, all do."""
        layout = self.engine.layout
        bands = 1
        if self.parallel is not None:
            _, _, _, latent_rows, _ = self.model_info.latent_shape(request)
            bands = decode_band_count(latent_rows, layout.replica_size)
        dtype = component_dtypes(self.device, self.config.dtype)["transformer"]
        # the output rank's share (it also holds the video), on every rank: the same decision everywhere
        estimate = estimate_request(
            self.model_info,
            request,
            sp_size=layout.sp_size,
            decode_bands=bands,
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
            offloaded=pipeline.offload.device_bytes_per_visit(),
            gathered=self._gathered_bytes,
        )
        sharing = (self.rank_info.local_world_size or 1) if self.device.type == "cpu" else 1
        limit = int(USABLE_FRACTION * available_memory_bytes(self.device))
        refuse = estimate.total * sharing > limit
        group = self.replica_group
        if group is not None:
            flag = torch.tensor([int(refuse)], dtype=torch.int32)
            flags = [torch.zeros_like(flag) for _ in range(layout.replica_size)]
            with collective("the memory check of a request"):
                torch.distributed.all_gather(flags, flag, group=group)
            first = layout.output_ranks()[self.replica]
            refusing = [first + r for r, f in enumerate(flags) if int(f)]
            if refusing and not refuse:
                raise ConfigError(f"the request does not fit the memory of rank(s) {refusing} (see their message)")
        if not refuse:
            return
        height, width = fitting_size(self.model_info, request, estimate.total * sharing, limit)
        where = f"{sharing} ranks share this machine's RAM" if sharing > 1 else f"on {self.device}"
        raise ConfigError(
            f"the request ({request.num_frames} frames of {request.width}x{request.height}) needs "
            f"{estimate.describe()} per rank ({where}), more than the {limit / 2**30:.2f} GiB this rank can use "
            f"({int(USABLE_FRACTION * 100)}% of the memory available now). It would fit at about {width}x{height}; or "
            "spread the decode over more ranks (the banded decode divides its memory by the number of ranks), or use "
            "a machine with more memory."
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


def separate_compile_time(timings: dict[str, float], compile_s: float, steps: int) -> None:
    """Report the seconds torch.compile spent during this request as ``timings["compile"]`` and take them out of
    the per-step denoising figure (the blocks compile inside the denoising loop; ``denoising`` stays the loop's wall
    time)."""
    compile_s = max(0.0, compile_s)  # a torch._dynamo.reset() meanwhile sets dynamo's counter back
    timings["compile"] = compile_s
    if "denoising" in timings:
        record_per_step_denoising(timings, steps, excluded_s=compile_s)
