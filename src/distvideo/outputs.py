"""What a rank hands back: one request's output, and one batch item's outcome.

Light on purpose (numpy only): the mp executor's driver unpickles these from its workers, and unpickling a class
imports its module. Were they defined in `distvideo.worker`, the driver's first answer would import diffusers and
torch's compiler stack (about 2.5 s on a 2-core machine, and memory a driver never needs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class WorkerOutput:
    rank: int
    frames: np.ndarray | None
    timings: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
    cache: dict[str, Any] | None = None  # the step cache's report (pipelines/caching.py); None when off
    # this rank's transformers' and text encoders' weights: {component: {"mode", "quantized_modules", "bytes"}}
    weights: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class ItemOutcome:
    """One batch item, as its replica's output rank reports it: the output (frames included) or why it failed."""

    index: int
    replica: int
    output: WorkerOutput | None = None
    error_type: str = ""
    error: str = ""
