"""What a rank hands back (one request's output, one batch item's outcome), and what the caller gets
(GenerationResult).

Light on purpose (numpy only): the mp executor's driver unpickles these from its workers, and unpickling a class
imports its module. Were they defined in `distvideo.worker`, the driver's first answer would import diffusers and
torch's compiler stack (about 2.5 s on a 2-core machine, and memory a driver never needs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from distvideo.request import ResolvedRequest


@dataclass
class WorkerOutput:
    rank: int
    frames: np.ndarray | None
    timings: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
    cache: dict[str, Any] | None = None  # the step cache's report (pipelines/caching/); None when off
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


@dataclass
class GenerationResult:
    frames: np.ndarray | None
    video_path: str | None
    seed: int
    timings: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
    request: ResolvedRequest | None = None
    # step caching: {"method", "computed_steps", "skipped_steps": [step indices]}; None when off (docs/caching.md)
    cache: dict[str, Any] | None = None
    # the output rank's weights per transformer and text encoder: {"mode", "quantized_modules", "bytes"}
    weights: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_summary(timings: dict[str, float], cache: dict[str, Any] | None) -> str:
    """What ran, for the summary line: the stages' seconds (compile apart from denoising) and the steps a step cache
    skipped."""
    parts = [f"denoising {timings.get('denoising', 0.0):.2f} s"]
    if "compile" in timings:
        parts.append(f"of which compiling {timings['compile']:.2f} s")
    parts.append(f"decoding {timings.get('decoding', 0.0):.2f} s")
    if cache:
        skipped = list(cache.get("skipped_steps", []))
        steps = len(skipped) + int(cache.get("computed_steps", 0))
        parts.append(f"cache {cache.get('method')}: skipped {len(skipped)} of {steps} steps {skipped}")
    return ", ".join(parts)
