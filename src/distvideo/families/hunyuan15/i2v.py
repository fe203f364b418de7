"""HunyuanVideo 1.5 image-to-video: the text-to-video stages with the image as condition, following diffusers'
HunyuanVideo15ImageToVideoPipeline: the image resized and centre-cropped to the video's size, its SigLIP tokens as the
image context, and its VAE latents as the first latent frame of the condition, behind a mask of ones there.
"""

from __future__ import annotations

from typing import Any

import torch

from distvideo.families.hunyuan15.t2v import HunyuanBatch, HunyuanVideo15T2VPipeline
from distvideo.models import compat
from distvideo.pipelines.base import Stage
from distvideo.pipelines.control import StepControl


class HunyuanVideo15I2VPipeline(HunyuanVideo15T2VPipeline):
    """HunyuanVideo 1.5 image-to-video: the condition comes from the request's image, computed once per replica."""

    def __init__(self, components: dict[str, Any], device: torch.device, *args: Any, **kwargs: Any):
        super().__init__(components, device, *args, **kwargs)
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        self.feature_extractor = components["feature_extractor"]
        self.video_processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.model.vae_scale_spatial)

    def stages(self, control: StepControl | None) -> list[Stage]:
        """Text-to-video's stages with the image as the condition."""
        image = {"conditioning": self.condition_on_image}
        return [(name, image.get(name, stage)) for name, stage in super().stages(control)]

    @torch.no_grad()
    def condition_on_image(self, batch: HunyuanBatch) -> None:
        assert batch.latents is not None
        condition, image_embeds = self.computed_once(lambda: self._image_condition(batch))
        batch.condition, batch.image_embeds = condition, image_embeds

    def _image_condition(self, batch: HunyuanBatch) -> list[torch.Tensor]:
        from PIL import Image

        req = batch.request
        assert batch.latents is not None
        image = self.video_processor.resize(
            Image.fromarray(req.image), height=req.height, width=req.width, resize_mode="crop"
        )
        image_latents, image_embeds = compat.hunyuan15_image_encoders()
        dtype = self.transformer.dtype
        with self.offload.on_device("image_encoder"):
            embeds = image_embeds(self.image_encoder, self.feature_extractor, image, self.device).to(dtype)
        with self.offload.on_device("vae"):
            first = image_latents(self.vae, self.video_processor, image, req.height, req.width, self.device)
        b, _, frames, rows, cols = batch.latents.shape
        latents = first.repeat(b, 1, frames, 1, 1)
        latents[:, :, 1:] = 0
        mask = torch.zeros(b, 1, frames, rows, cols, dtype=dtype, device=self.device)
        mask[:, :, 0] = 1.0
        return [torch.cat([latents.to(self.device, dtype), mask], dim=1), embeds]
