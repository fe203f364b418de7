"""Step caching that every rank agrees on: the transformer's blocks skipped at some denoising steps, decided once per
step from one value all ranks share (parallel/cache_decision.py), in the spirit of diffusers' cache hooks.

- session.py: a request's cache state and the base of a method;
- hooks.py: the hooks on the blocks (diffusers' HookRegistry), applied by the worker at load as a plan;
- one file per method: first_block.py, mag.py, taylorseer.py, and calibrate.py (``distvideo calibrate``'s run).
  A method is a :class:`CacheMethod` subclass listed in ``METHODS``; its defaults are a row of
  models/cache_ratios.py's ``METHOD_DEFAULTS``.

diffusers decides per call, so the conditional and unconditional branches (and, under sequence parallelism, every
shard) could decide differently; here each step has one decision, and a skipped step replays, per branch and per
rank, what the skipped blocks added. Every decision is reset at a switch of transformer (Wan2.2 A14B's experts).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from distvideo.models.cache_ratios import compile_refusal, ratios_key
from distvideo.models.family import ModelFamily
from distvideo.models.plans import get_plan
from distvideo.parallel.cache_decision import shared_decision
from distvideo.pipelines.caching.calibrate import Calibration
from distvideo.pipelines.caching.first_block import FirstBlockCache
from distvideo.pipelines.caching.hooks import HOOK_NAME, CacheSlot, StepCachePlan
from distvideo.pipelines.caching.mag import MagCache
from distvideo.pipelines.caching.session import CacheMethod, CacheSession, CacheSettings
from distvideo.pipelines.caching.taylorseer import TaylorSeerCache
from distvideo.request import ResolvedRequest

#: the methods, by the request's ``cache`` value
METHODS: dict[str, type[CacheMethod]] = {
    cls.name: cls for cls in (FirstBlockCache, MagCache, TaylorSeerCache, Calibration)
}


def new_session(request: ResolvedRequest, ratios: list[float], parallel: Any, do_cfg: bool) -> CacheSession:
    """The session of a resolved, cached request, deciding with this rank's sp group and CFG pair when `parallel` (a
    ParallelContext) has them."""
    settings = CacheSettings(
        threshold=float(request.cache_threshold or 0.0),
        warmup_steps=int(request.cache_warmup_steps or 0),
        max_skip=int(request.cache_max_skip or 0),
    )
    method = METHODS[request.cache](settings, ratios)
    return CacheSession(method, shared_decision(parallel, do_cfg))


def cache_plans(family: ModelFamily, *, compiled: bool) -> list[StepCachePlan]:
    """The step-cache plans for the family's transformers, sharing one slot (A14B's experts take turns in it): none
    where the family declares no cache points, or where the blocks are compiled (they would trace the decisions)."""
    if family.cache_points is None or compiled:
        return []
    slot = CacheSlot()
    return [StepCachePlan(name, family.cache_points, slot) for name in family.transformers]


def cache_slot(pipeline: Any) -> CacheSlot | None:
    """The slot of the step-cache plan the worker applied to the pipeline's transformers (None: no plan, as under
    --compile)."""
    plan = get_plan(getattr(pipeline, pipeline.model.family.transformers[0]), HOOK_NAME)
    return plan.slot if isinstance(plan, StepCachePlan) else None


@contextmanager
def step_cache(pipeline: Any, batch: Any) -> Iterator[CacheSession | None]:
    """The request's session in the transformers' slot for the denoising loop (None with the cache off); the report
    lands in ``batch.cache`` even when the loop stops early."""
    request = batch.request
    if request.cache == "none":
        yield None
        return
    slot = cache_slot(pipeline)
    if slot is None:  # no hooks (--compile): the edge refuses it first (VideoGenerator.generate_request); a batch item
        raise compile_refusal(request)  # meets it here
    model = pipeline.model
    ratios = model.cache_ratios.get(ratios_key(model.schedule(request).key(), request.num_inference_steps), [])
    session = new_session(request, ratios, pipeline.parallel, batch.do_cfg)
    slot.session = session
    try:
        yield session
    finally:
        slot.session = None
        session.end()
        batch.cache = session.report(len(batch.timesteps))


__all__ = [
    "METHODS",
    "CacheMethod",
    "CacheSession",
    "CacheSlot",
    "StepCachePlan",
    "cache_plans",
    "new_session",
    "step_cache",
]
