"""Between two denoising steps: report progress and decide, on every rank alike, whether the request stops.

A request stops when its deadline passed (`request_timeout`, measured by each rank from the start of its part) or
when the caller cancelled it. Ranks run in lockstep, and a rank that left while the others went on would leave them
waiting in a collective; so with several ranks the decision is one all-reduce (MAX) of each rank's reason after every
step, and every rank raises the same error at the same step. One tiny all-reduce per step costs nothing next to a
step's transformer forwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distvideo.errors import GenerationCancelled, GenerationTimeout
from distvideo.parallel.collectives import collective

KEEP_GOING, CANCELLED, TIMED_OUT = 0, 1, 2


class StepControl:
    """`cancelled()`: whether the caller asked this rank's request to stop; `on_progress(done, total)`: called after
    every step; `group`: the ranks that decide together (None: one rank); `timeout`: seconds from now."""

    def __init__(
        self,
        *,
        timeout: float | None = None,
        cancelled: Callable[[], bool] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        group: Any = None,
    ):
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.cancelled = cancelled
        self.on_progress = on_progress
        self.group = group

    def _local_reason(self) -> int:
        if self.cancelled is not None and self.cancelled():
            return CANCELLED
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return TIMED_OUT
        return KEEP_GOING

    def after_step(self, done: int, total: int) -> None:
        """Report progress, then stop (raise) if any rank's reason says so."""
        if self.on_progress is not None:
            self.on_progress(done, total)
        reason = self._local_reason()
        if self.group is not None:
            flag = torch.tensor([reason], dtype=torch.int32)
            with collective("the stop check after a denoising step"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            reason = int(flag.item())
        if reason == TIMED_OUT:
            raise GenerationTimeout(
                f"the request ran past request_timeout={self.timeout:g} s and was stopped after step {done} of "
                f"{total} on every rank; give it a longer request_timeout, or fewer steps, frames or pixels"
            )
        if reason == CANCELLED:
            raise GenerationCancelled(f"the request was cancelled; every rank stopped after step {done} of {total}")
