"""The calibration run of ``distvideo calibrate``: every step computed, and each step's residual magnitude (the mean
|residual| of the conditional branch over the real tokens, reduced across ranks) recorded; MagCache's ratios are
each step's magnitude over the previous step's."""

from __future__ import annotations

from typing import Any

import torch

from distvideo.pipelines.caching.session import CacheMethod, CacheSession, CacheSettings
from distvideo.request import CACHE_CALIBRATE


class Calibration(CacheMethod):
    name = CACHE_CALIBRATE

    def __init__(self, settings: CacheSettings, ratios: list[float]) -> None:
        super().__init__(settings, ratios)
        self.magnitudes: list[float] = []
        self._sum: torch.Tensor | None = None  # this step's (sum |r|, count) on this rank

    def computed(self, session: CacheSession, call: int, residual: torch.Tensor) -> None:
        super().computed(session, call, residual)
        if session.decision.contributes(call):
            r = session.decision.trim(residual).double()
            count = torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device)
            parts = torch.stack([r.abs().sum(), count])
            self._sum = parts if self._sum is None else self._sum + parts

    def _finish_step(self, session: CacheSession) -> None:
        if self._sum is not None:
            parts = session.decision.reduce(self._sum)
            self.magnitudes.append(float(parts[0] / parts[1]))
            self._sum = None

    begin_step = end = _finish_step

    def calibrated_ratios(self) -> list[float]:
        """Each step's residual magnitude over the previous step's (1 for the first)."""
        m = self.magnitudes
        return [1.0] + [m[i] / m[i - 1] if m[i - 1] > 0 else 1.0 for i in range(1, len(m))]

    def report(self, session: CacheSession) -> dict[str, Any]:
        return {"ratios": self.calibrated_ratios()}
