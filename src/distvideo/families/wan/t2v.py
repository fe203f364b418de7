"""Wan2.1 text-to-video: the shared stages with Wan's UMT5 text encoding, its latents normalisation and its step.

encode text -> timesteps -> noise -> denoise (classifier-free guidance) -> VAE decode -> uint8 frames. The arithmetic
follows diffusers' WanPipeline step for step, so the same seed gives the same frames.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distvideo.families.wan.attention import UlyssesAttnProcessor
from distvideo.families.wan.text_padding import TextProjectionMemo
from distvideo.families.wan.vae import apply_wan_bands
from distvideo.models.compat import prompt_clean
from distvideo.parallel.context import ParallelDeclarations
from distvideo.parallel.ulysses import SequencePoints
from distvideo.pipelines.base import Batch, DenoisingPipeline, Stage
from distvideo.pipelines.control import StepControl
from distvideo.request import ResolvedRequest


class WanT2VPipeline(DenoisingPipeline):
    """Wan2.1 T2V; the other Wan pipelines of this package build on it (the VAE constants, UMT5, the step)."""

    # Ulysses on the blocks' self-attention `attn1` (cross-attention stays local; rotary tables' sequence dim 1, ring
    # attention served); the Wan VAE's bands (Wan2.1's and Wan2.2's)
    parallel_points = ParallelDeclarations(
        SequencePoints("blocks", "attn1", UlyssesAttnProcessor, 1, True),
        apply_wan_bands,
        "AutoencoderKLWan",
        text_memo=TextProjectionMemo,
    )

    def __init__(self, components: dict[str, Any], device: torch.device, *args: Any, **kwargs: Any):
        super().__init__(components, device, *args, **kwargs)
        # the decode constants are fixed per model: build them once, not per request
        z = self.vae.config.z_dim
        self._latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1)
        self._latents_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1)

    def load_text_encoders(self, components: dict[str, Any]) -> dict[str, nn.Module]:
        self.tokenizer = components["tokenizer"]
        self.text_encoder = components["text_encoder"].eval()
        return {"text_encoder": self.text_encoder}

    def encode_prompt(self, text: str, request: ResolvedRequest) -> torch.Tensor:
        inputs = self.tokenizer(
            [prompt_clean(text)],
            padding="max_length",
            max_length=request.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = inputs.input_ids, inputs.attention_mask
        seq_len = int(mask.gt(0).sum(dim=1)[0])
        hidden = self.text_encoder(ids.to(self.device), mask.to(self.device)).last_hidden_state
        hidden = hidden.to(dtype=self.transformer.dtype)
        # zero the padding positions, as WanPipeline does: the transformer sees exact zeros there
        out = torch.zeros_like(hidden)
        out[:, :seq_len] = hidden[:, :seq_len]
        return out

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean = self._latents_mean.to(latents.device, latents.dtype)
        std = self._latents_std.to(latents.device, latents.dtype)
        return latents / std + mean

    def denoiser_at(self, t: torch.Tensor, batch: Batch) -> tuple[nn.Module, float]:
        """The transformer for step `t` and its guidance scale (one transformer here; Wan2.2 A14B switches)."""
        return self.transformer, batch.request.guidance_scale

    def predict_noise(self, latents: torch.Tensor, t: torch.Tensor, batch: Batch) -> torch.Tensor:
        model, scale = self.denoiser_at(t, batch)
        model_input = latents.to(self.transformer.dtype)
        timestep = t.expand(latents.shape[0])

        def noise(embeds: torch.Tensor) -> torch.Tensor:
            return model(hidden_states=model_input, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[
                0
            ]

        return self.guided(noise, batch, scale)

    def stages(self, control: StepControl | None) -> list[Stage]:
        return [
            ("text_encoding", self.encode_text),
            ("timesteps", self.prepare_timesteps),
            ("latents", self.prepare_latents),
            ("denoising", self.denoise_stage(control)),
            ("decoding", self.decode),
            ("frames", self.to_frames),
        ]
