"""Wan2.1 text-to-video as explicit stages over one batch dataclass.

validate -> encode text -> timesteps -> latents -> denoise (classifier-free guidance) -> VAE decode
-> uint8 frames. The arithmetic follows diffusers' WanPipeline step for step, so the same seed gives
the same frames; the stages are the seams where parallel plans shard and gather.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor
from tqdm.auto import tqdm

from distvideo.models.compat import prompt_clean
from distvideo.models.registry import ModelInfo
from distvideo.pipelines.caching import step_cache
from distvideo.pipelines.control import StepControl
from distvideo.pipelines.offload import ComponentOffload
from distvideo.pipelines.schedules import request_scheduler
from distvideo.request import GenerationRequest, is_guided

if TYPE_CHECKING:
    from distvideo.parallel.context import ParallelContext

logger = logging.getLogger(__name__)


@dataclass
class WanBatch:
    """Everything one request accumulates on its way through the stages."""

    request: GenerationRequest
    do_cfg: bool = False
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    scheduler: Any = None
    latents: torch.Tensor | None = None
    video: torch.Tensor | None = None
    frames: np.ndarray | None = None
    timings: dict[str, float] = field(default_factory=dict)
    cache: dict[str, Any] | None = None  # the step cache's report (pipelines/caching/); None when off


def record_per_step_denoising(timings: dict[str, float], steps: int, *, excluded_s: float = 0.0) -> None:
    """``timings["per_step_denoising"]``: the denoising loop's seconds per step, less `excluded_s` (what
    torch.compile spent in the loop; the loop's wall time stays ``timings["denoising"]``)."""
    timings["per_step_denoising"] = max(0.0, timings["denoising"] - excluded_s) / max(1, steps)


class WanT2VPipeline:
    """Runs one request on one rank. The worker applies every plan (speed plans, and the parallel ones: sequence/CFG
    parallel, parallel VAE) to the components before building the pipeline; the stages below stay the algorithm."""

    def __init__(
        self,
        components: dict[str, Any],
        device: torch.device,
        model: ModelInfo,
        *,
        show_progress: bool = True,
        parallel: ParallelContext | None = None,  # None: one rank
        offload: str = "none",  # what waits in host memory until its stage (pipelines/offload.py)
        offload_experts: bool | None = None,  # read by the two-expert pipelines only (pipelines/wan22_a14b.py)
    ):
        self.parallel = parallel
        self.model = model
        self.tokenizer = components["tokenizer"]
        self.text_encoder = components["text_encoder"].eval()
        self.transformer = components["transformer"].to(device).eval()
        self.vae = components["vae"].eval()
        encoder = components.get("image_encoder")  # Wan2.1 I2V's CLIP
        self.image_encoder = encoder.eval() if encoder is not None else None
        modules = {"text_encoder": self.text_encoder, "image_encoder": self.image_encoder, "vae": self.vae}
        self.offload = ComponentOffload(modules, device, offload)
        self.device = device
        self.show_progress = show_progress
        # the decode constants are fixed per model: build them once, not per request
        z = self.vae.config.z_dim
        self._latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1)
        self._latents_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1)

    # -- stages ----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, batch: WanBatch) -> None:
        req = batch.request
        with self.offload.on_device("text_encoder"):
            if self.parallel is not None:  # under CFG parallelism each half encodes only its branch's text
                negative = (req.negative_prompt or "") if batch.do_cfg else None
                batch.prompt_embeds, batch.negative_prompt_embeds = self.parallel.encode_text(
                    functools.partial(self._t5_embeds, max_len=req.max_sequence_length), req.prompt, negative
                )
                return
            batch.prompt_embeds = self._t5_embeds(req.prompt, req.max_sequence_length)
            if batch.do_cfg:
                batch.negative_prompt_embeds = self._t5_embeds(req.negative_prompt or "", req.max_sequence_length)

    def _t5_embeds(self, text: str, max_len: int) -> torch.Tensor:
        inputs = self.tokenizer(
            [prompt_clean(text)],
            padding="max_length",
            max_length=max_len,
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

    def prepare_timesteps(self, batch: WanBatch) -> None:
        scheduler = request_scheduler(self.model, batch.request, self.device)
        batch.scheduler = scheduler
        batch.timesteps = scheduler.timesteps

    def prepare_latents(self, batch: WanBatch) -> None:
        # drawn on a CPU generator seeded by the request: every rank draws the same noise, no broadcast
        generator = torch.Generator("cpu").manual_seed(batch.request.seed)
        batch.latents = randn_tensor(
            self.model.latent_shape(batch.request), generator=generator, device=self.device, dtype=torch.float32
        )

    def predict_noise(self, latents: torch.Tensor, t: torch.Tensor, batch: WanBatch) -> torch.Tensor:
        """The guided noise prediction for one step."""
        model_input = latents.to(self.transformer.dtype)
        timestep = t.expand(latents.shape[0])

        def noise(embeds: torch.Tensor) -> torch.Tensor:
            return self.transformer(
                hidden_states=model_input, timestep=timestep, encoder_hidden_states=embeds, return_dict=False
            )[0]

        assert batch.request.guidance_scale is not None
        return self.guided(noise, batch, batch.request.guidance_scale)

    def guided(self, noise: Callable[[torch.Tensor], torch.Tensor], batch: WanBatch, scale: float) -> torch.Tensor:
        """Classifier-free guidance over `noise(text embeddings)`: uncond + scale * (cond - uncond), or cond alone
        without guidance (this step's `scale` 1 or less: a two-expert model guides each expert by its own scale).
        Under CFG parallelism this rank runs one branch; one all-gather per step brings the other."""
        do_cfg = batch.do_cfg and scale > 1.0
        if self.parallel is not None and self.parallel.cfg_parallel:
            cond, uncond = self.parallel.cfg_branches(noise, batch.prompt_embeds, batch.negative_prompt_embeds, do_cfg)
        else:
            assert batch.prompt_embeds is not None
            cond = noise(batch.prompt_embeds)
            uncond = None
            if do_cfg:
                assert batch.negative_prompt_embeds is not None
                uncond = noise(batch.negative_prompt_embeds)
        if uncond is None:
            return cond
        return uncond + scale * (cond - uncond)

    @torch.no_grad()
    def denoise(self, batch: WanBatch, control: StepControl | None = None) -> None:
        assert batch.latents is not None and batch.timesteps is not None
        latents = batch.latents
        total = len(batch.timesteps)
        with self._progress(total) as bar, step_cache(self, batch) as cache:
            for done, t in enumerate(batch.timesteps, start=1):
                if cache is not None:
                    cache.begin_step(done - 1)
                noise_pred = self.predict_noise(latents, t, batch)
                latents = batch.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
                bar.update()
                if control is not None:  # progress, and a stop (cancel, deadline) decided alike on every rank
                    control.after_step(done, total)
        batch.latents = latents

    @torch.no_grad()
    def decode(self, batch: WanBatch) -> None:
        assert batch.latents is not None
        latents = batch.latents.to(self.device, dtype=self.vae.dtype)
        mean = self._latents_mean.to(latents.device, latents.dtype)
        std = self._latents_std.to(latents.device, latents.dtype)
        latents = latents / std + mean
        with self.offload.on_device("vae"):
            if self.parallel is not None:  # every rank decodes a band of rows; the video lands on rank 0 only
                batch.video = self.parallel.decode(latents)
            else:
                batch.video = self.vae.decode(latents, return_dict=False)[0]

    def to_frames(self, batch: WanBatch) -> None:
        if batch.video is None:  # a rank that does not hold the output
            return
        video = (batch.video[0].float() / 2 + 0.5).clamp(0, 1)  # (C, T, H, W) in [0, 1]
        frames = video.permute(1, 2, 3, 0).mul(255).round().to(torch.uint8)
        batch.frames = frames.cpu().numpy()

    # -- driver ----------------------------------------------------------------------------------
    def __call__(self, request: GenerationRequest, control: StepControl | None = None) -> WanBatch:
        """Run all stages for a request whose fields are resolved (see ModelInfo.resolve_request); `control` reports
        progress and may stop the request between denoising steps."""
        assert request.guidance_scale is not None
        batch = WanBatch(request=request, do_cfg=is_guided(request))
        with self._timed(batch, "text_encoding"):
            self.encode_text(batch)
        with self._timed(batch, "timesteps"):
            self.prepare_timesteps(batch)
        with self._timed(batch, "latents"):
            self.prepare_latents(batch)
        with self._timed(batch, "denoising"):
            self.denoise(batch, control)
        with self._timed(batch, "decoding"):
            self.decode(batch)
        with self._timed(batch, "frames"):
            self.to_frames(batch)
        assert batch.timesteps is not None
        record_per_step_denoising(batch.timings, len(batch.timesteps))
        return batch

    @contextmanager
    def _timed(self, batch: WanBatch, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        batch.timings[name] = time.perf_counter() - start

    def _progress(self, total: int) -> Any:
        enabled = self.show_progress and sys.stderr.isatty()
        return tqdm(total=total, desc="denoising", unit="step", file=sys.stderr, disable=not enabled, leave=False)
