"""The step cache's one decision across ranks: which rank's transformer call carries the deciding (conditional)
branch, the sum that makes a metric the single-rank one, and the trim that keeps a shard's real tokens.

A step is skipped or computed on every rank alike: first-block's metric is a pair of sums (the change of block 0's
residual and its size), each rank counting its real tokens only, all-reduced over the sequence-parallel group and over
the CFG pair (the unconditional rank adds zeros); the calibration's magnitudes are reduced the same way; mag and
taylorseer decide from the step index and calibrated ratios alone. This module is the only place that reduction is
written (pipelines/caching/ asks it through :class:`SharedDecision`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _first_call(call: int) -> bool:
    return call == 0


@dataclass(frozen=True)
class SharedDecision:
    """`contributes(call)`: whether this rank's `call`-th transformer call of a step (0: the first) is the
    conditional branch whose metric decides; `reduce` sums a tensor over the ranks that share a decision (identity on
    one rank); `trim` keeps a hidden-state shard's real tokens (drops the sequence padding)."""

    contributes: Callable[[int], bool] = _first_call
    reduce: Callable[[torch.Tensor], torch.Tensor] = _identity
    trim: Callable[[torch.Tensor], torch.Tensor] = _identity


def shared_decision(parallel: Any, do_cfg: bool) -> SharedDecision:
    """The decision of this rank under `parallel` (a ParallelContext; None on one rank): summed over its sp group
    and CFG pair where the layout has them. Without guidance both CFG halves run the conditional branch, and both
    contribute (each sum then counts twice, in numerator and denominator alike)."""
    if parallel is None:
        return SharedDecision()
    groups = parallel.groups
    sp_group = groups.sp if parallel.layout.sp_enabled else None
    cfg_group = groups.cfg if parallel.cfg_parallel else None
    contributes = _first_call
    if cfg_group is not None:  # the conditional branch runs on cfg rank 0
        cond_rank = groups.cfg_rank == 0 or not do_cfg

        def contributes(call: int) -> bool:
            return call == 0 and cond_rank

    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if sp_group is not None:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=sp_group)
        if cfg_group is not None:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=cfg_group)
        return out

    trim = _identity
    if parallel.ulysses is not None:
        ulysses = parallel.ulysses

        def trim(t: torch.Tensor) -> torch.Tensor:  # the shard of the running forward
            return t[:, : ulysses.shard.real_local_len]

    return SharedDecision(contributes, reduce, trim)
