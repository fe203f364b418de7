"""Wan2.2 A14B (T2V and I2V): the Wan2.1 stages with two experts and a switch between them.

Every step asks which expert denoises it: the high-noise expert (`transformer`, guidance scale `guidance_scale`)
while the timestep is at least ``boundary_ratio * num_train_timesteps``, then the low-noise expert (`transformer_2`,
`guidance_scale_2`). Text-to-video feeds the noise latents alone; image-to-video stacks the condition latents on
them as Wan2.1 I2V does (pipelines/wan_i2v.py). On CUDA only the active expert is on the device
(pipelines/experts.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distvideo.models.registry import ModelInfo
from distvideo.pipelines.control import StepControl
from distvideo.pipelines.experts import ExpertResidency, boundary_timestep, expert_for_step
from distvideo.pipelines.stages import StagedWanPipeline
from distvideo.pipelines.wan import WanBatch
from distvideo.pipelines.wan_i2v import WanI2VPipeline
from distvideo.request import GenerationRequest, is_guided

if TYPE_CHECKING:
    from distvideo.parallel.context import ParallelContext

logger = logging.getLogger(__name__)


class ExpertSwitch:
    """The expert switch of a two-expert pipeline (a mixin over a WanT2VPipeline)."""

    transformer: Any
    device: torch.device

    def init_experts(self, components: dict[str, Any], *, log: bool, offload: bool | None = None) -> None:
        """`offload`: the inactive expert in host memory (the engine's `offload_experts`); None: on with CUDA."""
        self.transformer_2 = components["transformer_2"].eval()
        self.experts = {"transformer": self.transformer, "transformer_2": self.transformer_2}
        self.residency = ExpertResidency(self.experts, self.device, offload=offload)
        if log and self.residency.offload:
            logger.info(
                "two experts: only the active one on %s; the other waits in pinned host memory (%.2f GiB kept off "
                "the device) and they swap at the boundary timestep",
                self.device,
                self.residency.resident_bytes("transformer_2") / 2**30,
            )

    def denoiser_at(self, t: torch.Tensor, batch: WanBatch) -> tuple[nn.Module, float]:
        """The expert for step `t` (made the one on the device) and its guidance scale."""
        req = batch.request
        assert req.boundary_ratio is not None and req.guidance_scale is not None and req.guidance_scale_2 is not None
        boundary = boundary_timestep(req.boundary_ratio, batch.scheduler.config.num_train_timesteps)
        step = expert_for_step(t, boundary, req.guidance_scale, req.guidance_scale_2)
        if step.name != self.residency.active:
            self.residency.activate(step.name)
            batch.timings["expert_swap"] = batch.timings.get("expert_swap", 0.0) + self.residency.last_swap_s
        return self.experts[step.name], step.guidance_scale


class Wan22T2VA14BPipeline(ExpertSwitch, StagedWanPipeline):
    """Wan2.2 T2V-A14B: encode text -> timesteps -> noise -> denoise with the expert switch -> decode -> frames."""

    def __init__(
        self,
        components: dict[str, Any],
        device: torch.device,
        model: ModelInfo,
        *,
        show_progress: bool = True,
        parallel: ParallelContext | None = None,
        offload: str = "none",
        offload_experts: bool | None = None,
    ):
        super().__init__(components, device, model, show_progress=show_progress, parallel=parallel, offload=offload)
        self.init_experts(components, log=parallel is None or parallel.rank == 0, offload=offload_experts)

    def __call__(self, request: GenerationRequest, control: StepControl | None = None) -> WanBatch:
        assert request.guidance_scale is not None
        batch = WanBatch(request=request, do_cfg=is_guided(request))
        return self.run_stages(
            batch,
            [
                ("text_encoding", self.encode_text),
                ("timesteps", self.prepare_timesteps),
                ("latents", self.prepare_latents),
                ("denoising", self.denoise_stage(control)),
                ("decoding", self.decode),
                ("frames", self.to_frames),
            ],
        )

    def predict_noise(self, latents: torch.Tensor, t: torch.Tensor, batch: WanBatch) -> torch.Tensor:
        model, scale = self.denoiser_at(t, batch)
        model_input = latents.to(self.transformer.dtype)
        timestep = t.expand(latents.shape[0])

        def noise(embeds: torch.Tensor) -> torch.Tensor:
            return model(hidden_states=model_input, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[
                0
            ]

        return self.guided(noise, batch, scale)


class Wan22I2VA14BPipeline(ExpertSwitch, WanI2VPipeline):
    """Wan2.2 I2V-A14B: Wan2.1 I2V's stages without CLIP (encode text -> timesteps -> noise -> condition on the first
    frame -> denoise with the expert switch -> decode -> frames)."""

    def __init__(
        self,
        components: dict[str, Any],
        device: torch.device,
        model: ModelInfo,
        *,
        show_progress: bool = True,
        parallel: ParallelContext | None = None,
        offload: str = "none",
        offload_experts: bool | None = None,
    ):
        super().__init__(components, device, model, show_progress=show_progress, parallel=parallel, offload=offload)
        self.init_experts(components, log=parallel is None or parallel.rank == 0, offload=offload_experts)
