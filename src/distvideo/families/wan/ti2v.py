"""Wan2.2 TI2V-5B: one model for text- and image-to-video, with a timestep per token.

encode text -> timesteps -> noise -> condition (with an image: the image alone through the Wan2.2 VAE, to stand in
for the first latent frame) -> denoise (each step gives every token its own timestep: t for the frames being
generated, 0 for the given first frame, whose latents replace the noisy ones before every step) -> put the given
first frame back -> VAE decode -> frames.

Without an image every token has the same timestep, as in diffusers' WanPipeline with ``expand_timesteps``; with one,
the arithmetic is diffusers' WanImageToVideoPipeline with ``expand_timesteps``, step for step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distvideo.families.wan.t2v import WanT2VPipeline
from distvideo.pipelines.base import Batch, Stage
from distvideo.pipelines.conditioning import condition_latents, pil_image, vae_image
from distvideo.pipelines.control import StepControl
from distvideo.request import ResolvedRequest, is_guided


@dataclass
class TokenTimestepBatch(Batch):
    """A request's state with its per-token timestep mask and, for image-to-video, the first frame's latents."""

    mask: torch.Tensor | None = None  # (1, 1, F, h, w) float32 latents grid: 0 where the frame is given, else 1
    condition: torch.Tensor | None = None  # (1, C, 1, h, w) latents of the given first frame, None for text-to-video


class Wan22TI2VPipeline(WanT2VPipeline):
    """Wan2.2 TI2V-5B: text-to-video, or image-to-video when the request has an image."""

    def new_batch(self, request: ResolvedRequest) -> TokenTimestepBatch:
        return TokenTimestepBatch(request=request, do_cfg=is_guided(request))

    def stages(self, control: StepControl | None) -> list[Stage]:
        return [
            ("text_encoding", self.encode_text),
            ("timesteps", self.prepare_timesteps),
            ("latents", self.prepare_latents),
            ("conditioning", self.condition_on_image),
            ("denoising", self.denoise_stage(control)),
            ("first_frame", self.restore_first_frame),
            ("decoding", self.decode),
            ("frames", self.to_frames),
        ]

    @torch.no_grad()
    def condition_on_image(self, batch: TokenTimestepBatch) -> None:
        """The timestep mask over the latent grid and, with an image, the latents of the given first frame."""
        assert batch.latents is not None
        req = batch.request
        if req.image is None:
            batch.mask = torch.ones(batch.latents.shape, dtype=torch.float32, device=self.device)
            return
        [batch.condition] = self.computed_once(lambda: [self.image_latents(req)])  # rank 0 encodes, all receive
        _, _, frames, rows, cols = batch.latents.shape
        mask = torch.ones(1, 1, frames, rows, cols, dtype=torch.float32, device=self.device)
        mask[:, :, 0] = 0
        batch.mask = mask

    def image_latents(self, req: ResolvedRequest) -> torch.Tensor:
        """(1, C, 1, h, w): the given first frame through the Wan2.2 VAE, normalised."""
        image = vae_image(pil_image(req.image), req.height, req.width, self.model.vae_scale_spatial).to(self.device)
        with self.offload.on_device("vae"):  # on the rank that computes it
            return condition_latents(self.vae, image.unsqueeze(2), self._latents_mean, self._latents_std)

    def predict_noise(self, latents: torch.Tensor, t: torch.Tensor, batch: Batch) -> torch.Tensor:
        assert isinstance(batch, TokenTimestepBatch) and batch.mask is not None
        mask = batch.mask
        if batch.condition is not None:  # the given first frame replaces the noisy one
            model_input = ((1 - mask) * batch.condition + mask * latents).to(self.transformer.dtype)
        else:
            model_input = latents.to(self.transformer.dtype)
        _, p_h, p_w = self.model.patch_size
        timestep = (mask[0][0][:, ::p_h, ::p_w] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)

        def noise(embeds: torch.Tensor) -> torch.Tensor:
            return self.transformer(
                hidden_states=model_input, timestep=timestep, encoder_hidden_states=embeds, return_dict=False
            )[0]

        return self.guided(noise, batch, batch.request.guidance_scale)

    def restore_first_frame(self, batch: TokenTimestepBatch) -> None:
        """Image-to-video: the given first frame's latents replace the denoised ones (nothing to do otherwise)."""
        if batch.condition is None:
            return
        assert batch.mask is not None and batch.latents is not None
        batch.latents = (1 - batch.mask) * batch.condition + batch.mask * batch.latents
