"""One request's step cache: the state every method shares (the step, the transformer calls of the step, the
decision, the residuals of the skipped blocks) and the base of a method (:class:`CacheMethod`).

A method decides once per step, at the step's first transformer call (the conditional branch): before block 0
(mag, taylorseer, the calibration: from the step index and calibrated ratios, no tensor) or from block 0's residual
(first-block: a metric reduced across ranks by parallel/cache_decision.py). The other calls of the step (the
unconditional branch) follow that decision. A computed step stores, per call, what the blocks after the decision point
added (`computed`); a skipped step adds what `replay` gives instead (the stored residual, or a forecast).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from distvideo.parallel.cache_decision import SharedDecision


@dataclass(frozen=True)
class CacheSettings:
    """A resolved request's cache options (models/cache_ratios.py filled them)."""

    threshold: float
    warmup_steps: int
    max_skip: int


class CacheMethod:
    """A step-cache method: one subclass per file in this package, registered in ``METHODS`` by its `name` (the
    request's ``cache`` value). The defaults here are MagCache's shape (decide before block 0, reuse the residual)."""

    name: ClassVar[str]
    #: whether the decision needs block 0's output (first-block); otherwise it is made before block 0 runs
    decides_after_first_block: ClassVar[bool] = False

    def __init__(self, settings: CacheSettings, ratios: list[float]) -> None:
        self.settings = settings
        self.ratios = list(ratios)

    def decide(self, session: CacheSession) -> bool:
        """Whether this step is skipped (at the step's first call, before block 0)."""
        return False

    def decide_from_first_block(self, session: CacheSession, residual: torch.Tensor, contributes: bool) -> bool:
        """Whether this step is skipped, from block 0's residual (`contributes`: this rank's call is the deciding
        branch); only methods with `decides_after_first_block`."""
        raise NotImplementedError

    def computed(self, session: CacheSession, call: int, residual: torch.Tensor) -> None:
        """A computed call's residual of the cached blocks (reused by a later skipped step)."""
        session.residuals[call] = residual

    def replay(self, session: CacheSession, call: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the skipped blocks add at this step, for this call, to `hidden_states` (their input)."""
        return session.residuals[call]

    def switched(self) -> None:
        """A new transformer (Wan2.2 A14B's expert boundary): forget the method's own state."""

    def begin_step(self, session: CacheSession) -> None:
        """Before the step's first call."""

    def end(self, session: CacheSession) -> None:
        """After the last step (or an early stop)."""

    def report(self, session: CacheSession) -> dict[str, Any]:
        """The method's own entries of the request's cache report."""
        return {}


@dataclass
class CacheSession:
    """The running request's cache state, in the transformers' slot while it denoises (hooks.py reads it)."""

    method: CacheMethod
    decision: SharedDecision = field(default_factory=SharedDecision)
    step: int = -1
    call: int = 0  # the transformer calls of this step so far (0: the conditional branch)
    skip: bool = False
    skipped: list[int] = field(default_factory=list)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # per call: what the cached blocks added
    starts: dict[int, torch.Tensor] = field(default_factory=dict)  # per call: the cached blocks' input
    consecutive: int = 0
    _module: int | None = None

    def begin_step(self, index: int) -> None:
        self.step, self.call, self.skip = index, 0, False
        self.method.begin_step(self)

    def end(self) -> None:
        self.method.end(self)

    def may_skip(self) -> bool:
        """Past the warmup, under the limit of skips in a row, and with something to replay."""
        settings = self.method.settings
        return self.step >= settings.warmup_steps and self.consecutive < settings.max_skip and bool(self.residuals)

    def decided(self, skip: bool) -> None:
        self.skip = skip
        if skip:
            self.skipped.append(self.step)
            self.consecutive += 1
        else:
            self.consecutive = 0

    def switch(self, transformer: int) -> None:
        """The step's first call, on the transformer of identity `transformer`: a transformer other than the last
        one's starts from nothing."""
        if self._module is not None and self._module != transformer:
            self.residuals.clear()
            self.method.switched()
        self._module = transformer

    def report(self, total_steps: int) -> dict[str, Any]:
        return {
            "method": self.method.name,
            "computed_steps": total_steps - len(self.skipped),
            "skipped_steps": list(self.skipped),
            **self.method.report(self),
        }
