"""The resolved engine: everything decided once, before any process starts or weight loads, and handed down.

`distvideo.executors.resolve_engine` builds it from an EngineConfig (like torchtitan's ParallelDims: one place that
knows every degree); executors, workers and the parallel context read it and never derive any of it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from distvideo.config import EngineConfig
from distvideo.launch import LaunchEnv
from distvideo.models.registry import ModelInfo
from distvideo.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class ResolvedEngine:
    """config: validated, `model` set, `executor` concrete ("inline" | "mp" | "external"), switches resolved;
    model: the checkpoint's JSON files; layout: cfg x sp over every rank; launch: the launcher's environment (the
    external executor only)."""

    config: EngineConfig
    model: ModelInfo
    layout: ParallelLayout
    launch: LaunchEnv | None = None

    @property
    def executor(self) -> str:
        return self.config.executor

    @property
    def world_size(self) -> int:
        return self.layout.world_size
