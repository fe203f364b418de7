"""Magnitude-ratio caching (MagCache, diffusers' ``hooks/mag_cache.py``): the calibrated ratio of each step's
residual magnitude to the previous one's (``distvideo calibrate``) says how far a reused residual drifts; a step is
skipped while the accumulated error, the sum of |1 - product of ratios| since the last computed step, stays under the
threshold, with at most `max_skip` skips in a row. The decision needs no tensor, so every rank makes it alike."""

from __future__ import annotations

from distvideo.pipelines.caching.session import CacheMethod, CacheSession, CacheSettings


class MagCache(CacheMethod):
    name = "mag"

    def __init__(self, settings: CacheSettings, ratios: list[float]) -> None:
        super().__init__(settings, ratios)
        self._acc_ratio, self._acc_err = 1.0, 0.0

    def decide(self, session: CacheSession) -> bool:
        step = session.step
        ratio = self.ratios[step] if step < len(self.ratios) else 1.0
        self._acc_ratio *= ratio
        self._acc_err += abs(1.0 - self._acc_ratio)
        skip = session.may_skip() and self._acc_err <= self.settings.threshold
        if not skip:
            self._acc_ratio, self._acc_err = 1.0, 0.0
        return skip

    def switched(self) -> None:
        self._acc_ratio, self._acc_err = 1.0, 0.0
