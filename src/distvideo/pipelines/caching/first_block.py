"""First-block caching (FBCache, diffusers' ``hooks/first_block_cache.py``), decided once per step for every rank:
block 0 always runs; when its residual changed by less than the threshold since the last computed step (relative
L1, the sums reduced across the ranks that share the decision), the other blocks are skipped and add the residual
they added at that step."""

from __future__ import annotations

import torch

from distvideo.pipelines.caching.session import CacheMethod, CacheSession, CacheSettings


class FirstBlockCache(CacheMethod):
    name = "first-block"
    decides_after_first_block = True

    def __init__(self, settings: CacheSettings, ratios: list[float]) -> None:
        super().__init__(settings, ratios)
        self._prev_first: torch.Tensor | None = None  # the deciding branch's block-0 residual, last computed step

    def decide_from_first_block(self, session: CacheSession, residual: torch.Tensor, contributes: bool) -> bool:
        """One all-reduce of (sum |r - r_prev|, sum |r_prev|) over the ranks that share the decision."""
        decision = session.decision
        parts = torch.zeros(2, dtype=torch.float64, device=residual.device)
        if contributes and self._prev_first is not None:
            r, prev = decision.trim(residual).double(), decision.trim(self._prev_first).double()
            parts[0], parts[1] = (r - prev).abs().sum(), prev.abs().sum()
        parts = decision.reduce(parts)
        change = float(parts[0] / parts[1]) if float(parts[1]) > 0 else float("inf")
        skip = session.may_skip() and change < self.settings.threshold
        if contributes and not skip:
            self._prev_first = residual
        return skip

    def switched(self) -> None:
        self._prev_first = None
