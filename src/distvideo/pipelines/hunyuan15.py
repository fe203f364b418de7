"""HunyuanVideo 1.5 text-to-video as explicit stages, following diffusers' HunyuanVideo15Pipeline step for step.

encode text (Qwen2.5-VL over the chat template, and ByT5 over the prompt's quoted glyph texts) -> timesteps (flow
matching, sigmas from 1 down) -> noise -> denoise (the transformer sees noise, zero condition latents and a zero
mask stacked on the channels, and zero image tokens; classifier-free guidance through the shared `guided`) ->
VAE decode (latents / scaling factor) -> uint8 frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from distvideo.models import compat
from distvideo.models.registry import ModelInfo
from distvideo.pipelines.control import StepControl
from distvideo.pipelines.offload import ComponentOffload
from distvideo.pipelines.schedules import request_scheduler
from distvideo.pipelines.stages import StagedWanPipeline
from distvideo.pipelines.wan import WanBatch
from distvideo.request import GenerationRequest, is_guided

if TYPE_CHECKING:
    from distvideo.parallel.context import ParallelContext

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
class HunyuanBatch(WanBatch):
    """A request's state; ``prompt_embeds`` / ``negative_prompt_embeds`` hold a :class:`HunyuanText` each (what the
    shared CFG split hands to the step's `noise`), ``condition`` the stacked condition latents and mask."""

    prompt_embeds: Any = None
    negative_prompt_embeds: Any = None
    condition: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None


class HunyuanVideo15T2VPipeline(StagedWanPipeline):
    """HunyuanVideo 1.5 text-to-video on one rank or one replica: the shared stages (noise, the denoising loop with
    guidance, frames) with the family's text encoding, timesteps, model input and decode."""

    def __init__(  # the shared stages' attributes; none of Wan's text or VAE constants
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
        self.parallel = parallel
        self.model = model
        self.tokenizer = components["tokenizer"]
        self.text_encoder = components["text_encoder"].eval()
        self.tokenizer_2 = components["tokenizer_2"]
        self.text_encoder_2 = components["text_encoder_2"].eval()
        self.transformer = components["transformer"].to(device).eval()
        self.vae = components["vae"].eval()
        encoder = components.get("image_encoder")  # image-to-video's SigLIP
        self.image_encoder = encoder.eval() if encoder is not None else None
        modules = {
            "text_encoder": self.text_encoder,
            "text_encoder_2": self.text_encoder_2,
            "image_encoder": self.image_encoder,
            "vae": self.vae,
        }
        self.offload = ComponentOffload(modules, device, offload)
        self.device = device
        self.show_progress = show_progress

    # -- stages ----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, batch: WanBatch) -> None:
        assert isinstance(batch, HunyuanBatch)
        req = batch.request
        encode: Any = self._text  # a HunyuanText per prompt: the shared CFG split passes it through untouched
        with self.offload.on_device("text_encoder", "text_encoder_2"):
            if self.parallel is not None:  # under CFG parallelism each half encodes only its branch's text
                negative = (req.negative_prompt or "") if batch.do_cfg else None
                batch.prompt_embeds, batch.negative_prompt_embeds = self.parallel.encode_text(
                    encode, req.prompt, negative
                )
                return
            batch.prompt_embeds = encode(req.prompt)
            if batch.do_cfg:
                batch.negative_prompt_embeds = encode(req.negative_prompt or "")

    def _text(self, prompt: str) -> HunyuanText:
        mllm, byt5 = compat.hunyuan15_text_encoders()
        embeds, mask = mllm(
            self.text_encoder,
            self.tokenizer,
            [prompt],
            self.device,
            tokenizer_max_length=QWEN_MAX_LENGTH,
            crop_start=PROMPT_CROP_START,
        )
        glyph, glyph_mask = byt5(self.tokenizer_2, self.text_encoder_2, [prompt], self.device, BYT5_MAX_LENGTH)
        dtype = self.transformer.dtype  # as diffusers: embeddings and masks in the transformer's dtype
        return HunyuanText(embeds.to(dtype), mask.to(dtype), glyph.to(dtype), glyph_mask.to(dtype))

    def prepare_timesteps(self, batch: WanBatch) -> None:
        scheduler = request_scheduler(self.model, batch.request, self.device, linear_sigmas=True)
        batch.scheduler = scheduler
        batch.timesteps = scheduler.timesteps

    def condition_on_nothing(self, batch: HunyuanBatch) -> None:
        """Text-to-video: zero condition latents, a zero mask and zero image tokens (the transformer then drops them)."""
        assert batch.latents is not None
        b, c, t, h, w = batch.latents.shape
        dtype = self.transformer.dtype
        batch.condition = torch.zeros(b, c + 1, t, h, w, dtype=dtype, device=self.device)
        image_dim = self.transformer.config.image_embed_dim
        batch.image_embeds = torch.zeros(b, IMAGE_TOKENS, image_dim, dtype=dtype, device=self.device)

    def predict_noise(self, latents: torch.Tensor, t: torch.Tensor, batch: WanBatch) -> torch.Tensor:
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

        assert batch.request.guidance_scale is not None
        return self.guided(noise, batch, batch.request.guidance_scale)  # type: ignore[arg-type]  # HunyuanText in

    @torch.no_grad()
    def decode(self, batch: WanBatch) -> None:
        assert batch.latents is not None
        latents = batch.latents.to(self.device, dtype=self.vae.dtype) / self.vae.config.scaling_factor
        with self.offload.on_device("vae"):
            if self.parallel is not None:  # the video lands on the replica's first rank only
                batch.video = self.parallel.decode(latents)
            else:
                batch.video = self.vae.decode(latents, return_dict=False)[0]

    # -- driver ----------------------------------------------------------------------------------
    def __call__(self, request: GenerationRequest, control: StepControl | None = None) -> WanBatch:
        assert request.guidance_scale is not None
        batch = HunyuanBatch(request=request, do_cfg=is_guided(request))
        return self.run_stages(
            batch,
            [
                ("text_encoding", self.encode_text),
                ("timesteps", self.prepare_timesteps),
                ("latents", self.prepare_latents),
                ("conditioning", self.condition_on_nothing),
                ("denoising", self.denoise_stage(control)),
                ("decoding", self.decode),
                ("frames", self.to_frames),
            ],
        )
