"""Wan2.2 A14B (T2V and I2V): the Wan2.1 stages with two experts and a switch between them.

Every step asks which expert denoises it: the high-noise expert (`transformer`, guidance scale `guidance_scale`)
while the timestep is at least ``boundary_ratio * num_train_timesteps``, then the low-noise expert (`transformer_2`,
`guidance_scale_2`). Text-to-video feeds the noise latents alone; image-to-video stacks the condition latents on
them as Wan2.1 I2V does (i2v.py). On CUDA only the active expert is on the device (pipelines/experts.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from distvideo.families.wan.i2v import WanI2VPipeline
from distvideo.families.wan.t2v import WanT2VPipeline
from distvideo.pipelines.base import Batch
from distvideo.pipelines.experts import ExpertResidency, boundary_timestep, expert_for_step

logger = logging.getLogger(__name__)


class ExpertSwitch(WanT2VPipeline):
    """The expert switch of a two-expert Wan pipeline: the second expert loaded beside the first, and `denoiser_at`
    choosing between them."""

    def __init__(self, components: dict[str, Any], device: torch.device, *args: Any, **kwargs: Any):
        super().__init__(components, device, *args, **kwargs)
        self.transformer_2 = components["transformer_2"].eval()
        self.experts = {"transformer": self.transformer, "transformer_2": self.transformer_2}
        # the inactive expert in host memory (the engine's `offload_experts`); None: on with CUDA
        self.residency = ExpertResidency(self.experts, self.device, offload=self.offload_experts)
        if (self.parallel is None or self.parallel.rank == 0) and self.residency.offload:
            logger.info(
                "two experts: only the active one on %s; the other waits in pinned host memory (%.2f GiB kept off "
                "the device) and they swap at the boundary timestep",
                self.device,
                self.residency.resident_bytes("transformer_2") / 2**30,
            )

    def denoiser_at(self, t: torch.Tensor, batch: Batch) -> tuple[nn.Module, float]:
        """The expert for step `t` (made the one on the device) and its guidance scale."""
        req = batch.request
        ratio, guidance_scale_2 = req.second_expert
        boundary = boundary_timestep(ratio, batch.scheduler.config.num_train_timesteps)
        step = expert_for_step(t, boundary, req.guidance_scale, guidance_scale_2)
        if step.name != self.residency.active:
            self.residency.activate(step.name)
            batch.timings["expert_swap"] = batch.timings.get("expert_swap", 0.0) + self.residency.last_swap_s
        return self.experts[step.name], step.guidance_scale


class Wan22T2VA14BPipeline(ExpertSwitch):
    """Wan2.2 T2V-A14B: encode text -> timesteps -> noise -> denoise with the expert switch -> decode -> frames."""


class Wan22I2VA14BPipeline(ExpertSwitch, WanI2VPipeline):
    """Wan2.2 I2V-A14B: Wan2.1 I2V's stages without CLIP (encode text -> timesteps -> noise -> condition on the first
    frame -> denoise with the expert switch -> decode -> frames)."""
