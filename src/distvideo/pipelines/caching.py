"""Step caching that every rank agrees on: first-block (FBCache) and magnitude (MagCache) skipping of the
transformer's blocks, decided once per denoising step from one reduced value.

The ideas are diffusers' ``hooks/first_block_cache.py`` and ``hooks/mag_cache.py``; the difference is where the
decision comes from. diffusers decides per call, so the conditional and unconditional branches (and, under sequence
parallelism, every shard) could decide differently. Here each step has one decision: first-block measures the
conditional branch's first-block residual against the last computed step's, as sums that are all-reduced over the
sequence-parallel group (each rank counts its real tokens only, so the sums are the single-rank ones) and over the
CFG pair (the unconditional rank adds zeros), so every rank sees the same value; mag's decision needs no tensor at
all (the calibrated ratios and the step index). A skipped step reuses, per branch and per rank, the residual the
remaining blocks added at the last computed step. Every decision is reset at a switch of transformer (Wan2.2
A14B's expert boundary). Which blocks the plan wraps, and what they take and return, is declared per transformer class
(`CACHE_POINTS`): Wan's single-stream blocks and HunyuanVideo 1.5's dual-stream ones share everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from distvideo.request import CACHE_CALIBRATE, GenerationRequest

Trim = Callable[[torch.Tensor], torch.Tensor]
Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class StepCacheSession:
    """One request's cache state. `branch_contributes(call)`: whether this rank's `call`-th transformer call of a step
    (0: the first) is the conditional branch whose metric decides; `reduce` sums a tensor over the ranks that share a
    decision (identity on one rank); `trim` keeps a hidden-state shard's real tokens."""

    method: str
    threshold: float
    warmup_steps: int
    max_skip: int
    ratios: list[float] = field(default_factory=list)
    branch_contributes: Callable[[int], bool] = lambda call: call == 0
    reduce: Reduce = lambda t: t
    trim: Trim = lambda t: t
    step: int = -1
    call: int = 0
    skip: bool = False
    skipped: list[int] = field(default_factory=list)
    magnitudes: list[float] = field(default_factory=list)  # calibration: per step, the residual's mean magnitude
    _module: int | None = None
    _consecutive: int = 0
    _prev_first: torch.Tensor | None = None  # the deciding branch's first-block residual at the last computed step
    _residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # per call: what the cached blocks added
    _starts: dict[int, torch.Tensor] = field(default_factory=dict)
    _acc_ratio: float = 1.0
    _acc_err: float = 0.0
    _mag_sum: torch.Tensor | None = None

    # -- the step ---------------------------------------------------------------------------------------
    def begin_step(self, index: int) -> None:
        self.step, self.call, self.skip = index, 0, False
        if self.method == CACHE_CALIBRATE and self._mag_sum is not None:
            self._finish_calibration_step()

    def end(self) -> None:
        if self.method == CACHE_CALIBRATE and self._mag_sum is not None:
            self._finish_calibration_step()

    def _may_skip(self) -> bool:
        return self.step >= self.warmup_steps and self._consecutive < self.max_skip and bool(self._residuals)

    def _decided(self, skip: bool) -> None:
        self.skip = skip
        if skip:
            self.skipped.append(self.step)
            self._consecutive += 1
        else:
            self._consecutive = 0

    def _switch(self, module: nn.Module) -> None:
        """A new transformer (an expert boundary): forget everything the old one left."""
        if self._module is not None and self._module != id(module):
            self._residuals.clear()
            self._prev_first = None
            self._acc_ratio, self._acc_err = 1.0, 0.0
        self._module = id(module)

    def _decide_mag(self) -> None:
        ratio = self.ratios[self.step] if self.step < len(self.ratios) else 1.0
        self._acc_ratio *= ratio
        self._acc_err += abs(1.0 - self._acc_ratio)
        skip = self._may_skip() and self._acc_err <= self.threshold
        if not skip:
            self._acc_ratio, self._acc_err = 1.0, 0.0
        self._decided(skip)

    def _decide_first_block(self, residual: torch.Tensor, contributes: bool) -> None:
        """One all-reduce of (sum |r - r_prev|, sum |r_prev|) over the ranks that share the decision."""
        parts = torch.zeros(2, dtype=torch.float64, device=residual.device)
        if contributes and self._prev_first is not None:
            r, prev = self.trim(residual).double(), self.trim(self._prev_first).double()
            parts[0], parts[1] = (r - prev).abs().sum(), prev.abs().sum()
        parts = self.reduce(parts)
        change = float(parts[0] / parts[1]) if float(parts[1]) > 0 else float("inf")
        self._decided(self._may_skip() and change < self.threshold)
        if contributes and not self.skip:
            self._prev_first = residual

    # -- calibration --------------------------------------------------------------------------------------
    def _record_magnitude(self, residual: torch.Tensor) -> None:
        r = self.trim(residual).double()
        parts = torch.stack([r.abs().sum(), torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device)])
        self._mag_sum = parts if self._mag_sum is None else self._mag_sum + parts

    def _finish_calibration_step(self) -> None:
        assert self._mag_sum is not None
        parts = self.reduce(self._mag_sum)
        self.magnitudes.append(float(parts[0] / parts[1]))
        self._mag_sum = None

    def calibrated_ratios(self) -> list[float]:
        """MagCache's ratios: each step's residual magnitude over the previous step's (1 for the first)."""
        m = self.magnitudes
        return [1.0] + [m[i] / m[i - 1] if m[i - 1] > 0 else 1.0 for i in range(1, len(m))]

    def report(self, total_steps: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "computed_steps": total_steps - len(self.skipped),
            "skipped_steps": list(self.skipped),
        }
        if self.method == CACHE_CALIBRATE:
            out["ratios"] = self.calibrated_ratios()
        return out


@dataclass
class CacheSlot:
    """Where the pipeline puts the running request's session; the plans' block wrappers read it (None: off)."""

    session: StepCacheSession | None = None


@dataclass(frozen=True)
class CachePoints:
    """Where a transformer class takes the step cache: the attribute holding its blocks, and whether each block also
    takes and returns the text stream (`text_stream`: a dual-stream block, called as ``block(hidden_states,
    encoder_hidden_states, ...)`` and returning both). Only the video stream's residual is cached and replayed: a
    skipped block hands the text stream on unchanged, which is exact because the transformer reads nothing of the
    text stream after its last block."""

    blocks: str
    text_stream: bool = False

    def video(self, out: Any) -> torch.Tensor:
        """The video stream of a block's output."""
        return out[0] if self.text_stream else out

    def passed_on(self, hidden_states: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What a skipped block returns: `hidden_states`, with the block's text stream input beside it."""
        if not self.text_stream:
            return hidden_states
        text = args[0] if args else kwargs["encoder_hidden_states"]
        return hidden_states, text


#: The declarations, by diffusers transformer class: Wan's single-stream blocks; HunyuanVideo 1.5's dual-stream
#: (MMDiT) blocks, whose text stream passes through a skipped step.
CACHE_POINTS: dict[str, CachePoints] = {
    "WanTransformer3DModel": CachePoints("blocks"),
    "HunyuanVideo15Transformer3DModel": CachePoints("transformer_blocks", text_stream=True),
}


def cache_points(transformer: nn.Module) -> CachePoints:
    name = type(transformer).__name__
    if name not in CACHE_POINTS:
        raise TypeError(f"step caching does not know {name}; it serves {', '.join(CACHE_POINTS)}")
    return CACHE_POINTS[name]


@dataclass
class StepCachePlan:
    """Wraps every block's forward of a transformer declared in `CACHE_POINTS`: with no session in `slot` the wrapper
    only calls the block (frames byte-identical to no plan); with one, block 0 decides (first-block: from its
    residual; mag: from the ratios) and a skipped step's blocks return the cached residual instead of running."""

    component: str
    slot: CacheSlot
    name: ClassVar[str] = "step-cache"

    def apply(self, module: nn.Module) -> Callable[[], None]:
        points = cache_points(module)
        blocks = list(getattr(module, points.blocks, []))
        if len(blocks) < 2:
            raise TypeError(f"{self.component} ({type(module).__name__}) has no list of at least two blocks")
        originals = [block.forward for block in blocks]
        last = len(blocks) - 1
        for index, block in enumerate(blocks):
            block.forward = self._wrapped(module, points, originals[index], index, last)  # type: ignore[method-assign]

        def undo() -> None:
            for block in blocks:
                del block.forward  # the instance attribute: the class's forward shows again

        return undo

    def _wrapped(
        self, module: nn.Module, points: CachePoints, forward: Callable[..., Any], index: int, last: int
    ) -> Callable[..., Any]:
        slot = self.slot

        def cached_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            session = slot.session
            if session is None:
                return forward(hidden_states, *args, **kwargs)
            if index == 0:
                return _first_block(session, module, points, forward, hidden_states, args, kwargs)
            call = session.call - 1  # block 0 counted this call
            if session.skip:
                if index == last:
                    return points.passed_on(hidden_states + session._residuals[call], args, kwargs)
                return points.passed_on(hidden_states, args, kwargs)
            out = forward(hidden_states, *args, **kwargs)
            if index == last:
                session._residuals[call] = points.video(out) - session._starts.pop(call)
                if session.method == CACHE_CALIBRATE and session.branch_contributes(call):
                    session._record_magnitude(session._residuals[call])
            return out

        return cached_forward


def _first_block(
    session: StepCacheSession,
    module: nn.Module,
    points: CachePoints,
    forward: Callable[..., Any],
    hidden_states: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    call = session.call
    session.call += 1
    if call == 0:
        session._switch(module)
        if session.method == "mag":
            session._decide_mag()
    if session.method == "mag":
        if session.skip:  # every block skipped: block 0's wrapper passes the input on, the last adds the residual
            return points.passed_on(hidden_states, args, kwargs)
        session._starts[call] = hidden_states
        return forward(hidden_states, *args, **kwargs)
    out = forward(hidden_states, *args, **kwargs)
    video = points.video(out)
    if session.method == "first-block" and call == 0:
        session._decide_first_block(video - hidden_states, session.branch_contributes(0))
    if not session.skip:
        session._starts[call] = video if session.method == "first-block" else hidden_states
    return out


# --- building a session for a request -------------------------------------------------------------------------------
def session_for(
    request: GenerationRequest, ratios: list[float], parallel: Any, do_cfg: bool
) -> StepCacheSession | None:
    """The session of a resolved request (None with the cache off), with the reduction over this rank's sp group and
    CFG pair when `parallel` (a ParallelContext) has them."""
    if request.cache in (None, "none"):
        return None
    session = StepCacheSession(
        method=request.cache,
        threshold=float(request.cache_threshold or 0.0),
        warmup_steps=int(request.cache_warmup_steps or 0),
        max_skip=int(request.cache_max_skip or 0),
        ratios=list(ratios),
    )
    if parallel is None:
        return session
    groups = parallel.groups
    sp_group = groups.sp if parallel.layout.sp_enabled else None
    cfg_group = groups.cfg if parallel.cfg_parallel else None
    if cfg_group is not None:  # the conditional branch runs on cfg rank 0; without guidance both halves run it
        cond_rank = groups.cfg_rank == 0 or not do_cfg
        session.branch_contributes = lambda call: call == 0 and cond_rank

    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if sp_group is not None:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=sp_group)
        if cfg_group is not None:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=cfg_group)
        return out

    session.reduce = reduce
    if parallel.ulysses is not None:
        ulysses = parallel.ulysses
        session.trim = lambda t: t[:, : ulysses.shard.real_local_len]
    return session


def cache_slot(pipeline: Any) -> CacheSlot | None:
    """The slot shared by the step-cache plans on the pipeline's transformers, the plans applied at the first cached
    request (so a pipeline that never caches carries none); None under --compile, which the plan does not serve."""
    from distvideo.models.plans import applied_plans, apply_plan, get_plan

    names = pipeline.model.family.transformers
    modules = [getattr(pipeline, name) for name in names]
    plan = get_plan(modules[0], StepCachePlan.name)
    if isinstance(plan, StepCachePlan):
        return plan.slot
    if any("compile" in applied_plans(module) for module in modules):
        return None
    slot = CacheSlot()
    for name, module in zip(names, modules, strict=True):
        apply_plan(module, StepCachePlan(name, slot))
    return slot


@contextmanager
def step_cache(pipeline: Any, batch: Any) -> Iterator[StepCacheSession | None]:
    """The request's session in the transformers' slot for the denoising loop (None with the cache off); the report
    lands in ``batch.cache`` even when the loop stops early."""
    from distvideo.errors import ConfigError
    from distvideo.models.cache_ratios import ratios_key

    request = batch.request
    if request.cache in (None, "none"):
        yield None
        return
    slot = cache_slot(pipeline)
    if slot is None:
        raise ConfigError(
            f"cache (--cache {request.cache}): step caching is not served with --compile (the compiled blocks would "
            "trace the cache's per-step decisions); drop one of them"
        )
    model = pipeline.model
    ratios = model.cache_ratios.get(ratios_key(model.schedule(request).key(), request.num_inference_steps), [])
    session = session_for(request, ratios, pipeline.parallel, batch.do_cfg)
    slot.session = session
    try:
        yield session
    finally:
        slot.session = None
        if session is not None:
            session.end()
            batch.cache = session.report(len(batch.timesteps))
