"""The family-neutral pipeline (base.py: a request's state through named stages; the worker holds a `Pipeline`), the
stages the families share (conditioning, experts, schedules, offload, the step cache). The families' own pipelines
live in their packages (distvideo/families/<name>/)."""

from distvideo.pipelines.base import Batch, DenoisingPipeline, Pipeline

__all__ = ["Batch", "DenoisingPipeline", "Pipeline"]
