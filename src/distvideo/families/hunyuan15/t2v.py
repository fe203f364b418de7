"""HunyuanVideo 1.5 text-to-video on the shared stages, following diffusers' HunyuanVideo15Pipeline step for step.

encode text (Qwen2.5-VL over the chat template, and ByT5 over the prompt's quoted glyph texts) -> timesteps (flow
matching, sigmas from 1 down) -> noise -> denoise (the transformer sees noise, zero condition latents and a zero
mask stacked on the channels, and zero image tokens; classifier-free guidance through the shared `guided`) ->
VAE decode (latents / scaling factor) -> uint8 frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distvideo.families.hunyuan15.attention import JointUlyssesAttnProcessor
from distvideo.families.hunyuan15.vae import apply_hunyuan15_bands
from distvideo.models import compat
from distvideo.parallel.context import ParallelDeclarations
from distvideo.parallel.ulysses import SequencePoints
from distvideo.pipelines.base import Batch, DenoisingPipeline, Stage
from distvideo.pipelines.control import StepControl
from distvideo.request import ResolvedRequest, is_guided

# HunyuanVideo15Pipeline's constants (its __init__): the chat template's system prompt is cropped off (108 tokens),
# then 1000 text tokens; 256 ByT5 tokens; 729 image tokens (SigLIP's), zero in text-to-video.
PROMPT_CROP_START = 108
QWEN_MAX_LENGTH = 1000
BYT5_MAX_LENGTH = 256
IMAGE_TOKENS = 729


@dataclass
class HunyuanText:
    """One prompt's text conditioning: the Qwen2.5-VL tokens and the ByT5 glyph tokens, each with its mask."""

    embeds: torch.Tensor
    mask: torch.Tensor
    glyph_embeds: torch.Tensor
    glyph_mask: torch.Tensor


@dataclass
class HunyuanBatch(Batch):
    """A request's state; ``prompt_embeds`` / ``negative_prompt_embeds`` hold a :class:`HunyuanText` each (what the
    shared CFG split hands to the step's `noise`), ``condition`` the stacked condition latents and mask."""

    condition: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None


class HunyuanVideo15T2VPipeline(DenoisingPipeline):
    """HunyuanVideo 1.5 text-to-video on one rank or one replica: the shared stages with the family's two text
    encoders, linear sigmas, model input and decode."""

    linear_sigmas = True
    # Ulysses on the dual-stream blocks' joint attention (text and video tokens together: attention.py; rotary tables'
    # sequence dim 0, ring attention served); its VAE's bands (vae.py)
    parallel_points = ParallelDeclarations(
        SequencePoints("transformer_blocks", "attn", JointUlyssesAttnProcessor, 0, True),
        apply_hunyuan15_bands,
        "AutoencoderKLHunyuanVideo15",
    )

    def load_text_encoders(self, components: dict[str, Any]) -> dict[str, nn.Module]:
        self.tokenizer = components["tokenizer"]
        self.text_encoder = components["text_encoder"].eval()
        self.tokenizer_2 = components["tokenizer_2"]
        self.text_encoder_2 = components["text_encoder_2"].eval()
        return {"text_encoder": self.text_encoder, "text_encoder_2": self.text_encoder_2}

    def new_batch(self, request: ResolvedRequest) -> HunyuanBatch:
        return HunyuanBatch(request=request, do_cfg=is_guided(request))

    def stages(self, control: StepControl | None) -> list[Stage]:
        return [
            ("text_encoding", self.encode_text),
            ("timesteps", self.prepare_timesteps),
            ("latents", self.prepare_latents),
            ("conditioning", self.condition_on_nothing),
            ("denoising", self.denoise_stage(control)),
            ("decoding", self.decode),
            ("frames", self.to_frames),
        ]

    def encode_prompt(self, text: str, request: ResolvedRequest) -> HunyuanText:
        mllm, byt5 = compat.hunyuan15_text_encoders()
        embeds, mask = mllm(
            self.text_encoder,
            self.tokenizer,
            [text],
            self.device,
            tokenizer_max_length=QWEN_MAX_LENGTH,
            crop_start=PROMPT_CROP_START,
        )
        glyph, glyph_mask = byt5(self.tokenizer_2, self.text_encoder_2, [text], self.device, BYT5_MAX_LENGTH)
        dtype = self.transformer.dtype  # as diffusers: embeddings and masks in the transformer's dtype
        return HunyuanText(embeds.to(dtype), mask.to(dtype), glyph.to(dtype), glyph_mask.to(dtype))

    def condition_on_nothing(self, batch: HunyuanBatch) -> None:
        """Text-to-video: zero condition latents, a zero mask and zero image tokens (the transformer then drops them)."""
        assert batch.latents is not None
        b, c, t, h, w = batch.latents.shape
        dtype = self.transformer.dtype
        batch.condition = torch.zeros(b, c + 1, t, h, w, dtype=dtype, device=self.device)
        image_dim = self.transformer.config.image_embed_dim
        batch.image_embeds = torch.zeros(b, IMAGE_TOKENS, image_dim, dtype=dtype, device=self.device)

    def predict_noise(self, latents: torch.Tensor, t: torch.Tensor, batch: Batch) -> torch.Tensor:
        assert isinstance(batch, HunyuanBatch) and batch.condition is not None
        model_input = torch.cat([latents.to(self.transformer.dtype), batch.condition], dim=1)
        timestep = t.expand(model_input.shape[0]).to(model_input.dtype)

        def noise(text: HunyuanText) -> torch.Tensor:
            return self.transformer(
                hidden_states=model_input,
                image_embeds=batch.image_embeds,
                timestep=timestep,
                encoder_hidden_states=text.embeds,
                encoder_attention_mask=text.mask,
                encoder_hidden_states_2=text.glyph_embeds,
                encoder_attention_mask_2=text.glyph_mask,
                return_dict=False,
            )[0]

        return self.guided(noise, batch, batch.request.guidance_scale)

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / self.vae.config.scaling_factor
