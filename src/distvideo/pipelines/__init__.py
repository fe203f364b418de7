"""Pipelines: a request dataclass flowing through explicit stages; one class per model family."""

from distvideo.pipelines.wan import WanT2VPipeline

PIPELINES = {"wan_t2v": WanT2VPipeline}

__all__ = ["PIPELINES", "WanT2VPipeline"]
