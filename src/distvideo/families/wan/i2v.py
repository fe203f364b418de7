"""Wan2.1 image-to-video: the Wan2.1 stages plus the image conditioning.

encode text -> encode the image with CLIP -> timesteps -> noise -> condition (the first frame through the VAE, and a
mask marking it as given) -> denoise (each step sees the noise latents with the condition latents stacked on its
channels, and cross-attends to the CLIP image tokens before the text) -> VAE decode -> frames.

The arithmetic follows diffusers' WanImageToVideoPipeline step for step. Wan2.2 I2V-A14B runs the same stages
without CLIP, with its two experts (a14b.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distvideo.families.wan.t2v import WanT2VPipeline
from distvideo.pipelines.base import Batch, Stage
from distvideo.pipelines.conditioning import (
    clip_image_tokens,
    condition_latents,
    first_frame_mask,
    first_frame_video,
    pil_image,
    vae_image,
)
from distvideo.pipelines.control import StepControl
from distvideo.request import ResolvedRequest, is_guided


@dataclass
class ImageBatch(Batch):
    """A request's state with its image conditioning."""

    image: Any = None  # the request's image as a PIL image
    image_embeds: torch.Tensor | None = None  # CLIP image tokens (Wan2.1 I2V), None without an image encoder
    condition: torch.Tensor | None = None  # mask channels + condition latents, stacked on the noise channels


class WanI2VPipeline(WanT2VPipeline):
    """Wan2.1 I2V (and, with its expert switch, Wan2.2 I2V-A14B): Wan2.1's stages with the image conditioning."""

    def __init__(self, components: dict[str, Any], device: torch.device, *args: Any, **kwargs: Any):
        super().__init__(components, device, *args, **kwargs)
        self.image_processor = components.get("image_processor")

    def new_batch(self, request: ResolvedRequest) -> ImageBatch:
        return ImageBatch(request=request, do_cfg=is_guided(request), image=pil_image(request.image))

    def stages(self, control: StepControl | None) -> list[Stage]:
        return [
            ("text_encoding", self.encode_text),
            ("image_encoding", self.encode_image),
            ("timesteps", self.prepare_timesteps),
            ("latents", self.prepare_latents),
            ("conditioning", self.condition_on_first_frame),
            ("denoising", self.denoise_stage(control)),
            ("decoding", self.decode),
            ("frames", self.to_frames),
        ]

    # -- the image conditioning (computed on rank 0 and broadcast under a parallel layout) ---------------------
    @torch.no_grad()
    def encode_image(self, batch: ImageBatch) -> None:
        """CLIP image tokens, which every block's cross-attention sees before the text (Wan2.1 I2V only)."""
        if self.image_encoder is not None:
            [batch.image_embeds] = self.computed_once(lambda: [self.clip_tokens(batch)])

    def clip_tokens(self, batch: ImageBatch) -> torch.Tensor:
        with self.offload.on_device("image_encoder"):  # on the rank that computes it
            tokens = clip_image_tokens(self.image_encoder, self.image_processor, batch.image, self.device)
        return tokens.to(self.transformer.dtype)

    @torch.no_grad()
    def condition_on_first_frame(self, batch: ImageBatch) -> None:
        """The first frame through the VAE (followed by black frames), normalised, behind a mask marking it given."""
        [batch.condition] = self.computed_once(lambda: [self.first_frame_condition(batch)])

    def first_frame_condition(self, batch: ImageBatch) -> torch.Tensor:
        req = batch.request
        image = vae_image(batch.image, req.height, req.width, self.model.vae_scale_spatial).to(self.device)
        with self.offload.on_device("vae"):  # on the rank that computes it
            latents = condition_latents(
                self.vae, first_frame_video(image, req.num_frames), self._latents_mean, self._latents_std
            )
        _, _, _, rows, cols = self.model.latent_shape(req)
        mask = first_frame_mask(req.num_frames, rows, cols, self.model.vae_scale_temporal).to(latents.device)
        return torch.concat([mask, latents], dim=1)

    # -- one step --------------------------------------------------------------------------------------------------
    def predict_noise(self, latents: torch.Tensor, t: torch.Tensor, batch: Batch) -> torch.Tensor:
        assert isinstance(batch, ImageBatch) and batch.condition is not None
        model, scale = self.denoiser_at(t, batch)
        model_input = torch.cat([latents, batch.condition], dim=1).to(self.transformer.dtype)
        timestep = t.expand(latents.shape[0])
        image_embeds = batch.image_embeds

        def noise(embeds: torch.Tensor) -> torch.Tensor:
            return model(
                hidden_states=model_input,
                timestep=timestep,
                encoder_hidden_states=embeds,
                encoder_hidden_states_image=image_embeds,
                return_dict=False,
            )[0]

        return self.guided(noise, batch, scale)
