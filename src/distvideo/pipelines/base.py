"""The family-neutral pipeline: a request's state flowing through named, timed stages that read as the algorithm.

validate -> encode text -> timesteps -> noise -> (the family's conditioning) -> denoise (classifier-free guidance,
the step cache's points, the caller's control after every step) -> VAE decode -> uint8 frames.

A family (distvideo/families/<name>/) subclasses :class:`DenoisingPipeline` and supplies what is its own: its text
encoders and how one prompt is encoded, how a step calls its transformer (`predict_noise`, through the shared
`guided`), how its latents are unscaled before the VAE, and the list of its stages. Everything else (noise drawn
alike on every rank, the schedule, guidance and its CFG split, the denoising loop, the decode with its parallel
bands, the frames, the timings, the conditioning computed once per replica) is here, once. The worker holds a
:class:`Pipeline`.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor
from torch import nn
from tqdm.auto import tqdm

from distvideo.models.registry import ModelInfo
from distvideo.parallel.context import ParallelDeclarations
from distvideo.pipelines.caching import step_cache
from distvideo.pipelines.control import StepControl
from distvideo.pipelines.offload import ComponentOffload
from distvideo.pipelines.schedules import request_scheduler
from distvideo.request import ResolvedRequest, is_guided

if TYPE_CHECKING:
    from distvideo.parallel.context import ParallelContext

logger = logging.getLogger(__name__)

Stage = tuple[str, Callable[[Any], None]]


@dataclass
class Batch:
    """Everything one request accumulates on its way through the stages. ``prompt_embeds`` and
    ``negative_prompt_embeds`` hold what the family's `encode_prompt` returns for one prompt (a tensor, or the
    family's own record of several), handed to its step's `noise` untouched by the shared guidance and CFG split."""

    request: ResolvedRequest
    do_cfg: bool = False
    prompt_embeds: Any = None
    negative_prompt_embeds: Any = None
    timesteps: torch.Tensor | None = None
    scheduler: Any = None
    latents: torch.Tensor | None = None
    video: torch.Tensor | None = None
    frames: np.ndarray | None = None
    timings: dict[str, float] = field(default_factory=dict)
    cache: dict[str, Any] | None = None  # the step cache's report (pipelines/caching/); None when off


class Pipeline(Protocol):
    """What the worker holds and calls: one request, run on this rank, with the loaded modules it plans over."""

    model: ModelInfo
    transformer: nn.Module
    offload: ComponentOffload

    def __call__(self, request: ResolvedRequest, control: StepControl | None = None) -> Batch: ...


def record_per_step_denoising(timings: dict[str, float], steps: int, *, excluded_s: float = 0.0) -> None:
    """``timings["per_step_denoising"]``: the denoising loop's seconds per step, less `excluded_s` (what
    torch.compile spent in the loop; the loop's wall time stays ``timings["denoising"]``)."""
    timings["per_step_denoising"] = max(0.0, timings["denoising"] - excluded_s) / max(1, steps)


class DenoisingPipeline(ABC):
    """Runs one request on one rank. The worker applies every plan (speed plans, and the parallel ones: sequence/CFG
    parallel, parallel VAE, the step cache) to the components before building the pipeline; the stages stay the
    algorithm. Subclasses give the family's parts (the abstract methods) and may add stages of their own."""

    #: the family spaces its steps by sigmas 1 ... 1/steps where a request gives no list (models/schedules.py)
    linear_sigmas = False
    #: where the parallel plans hook the family's modules (Ulysses' points, the VAE's bands); the worker hands them
    #: to ParallelContext.plans before it builds the pipeline
    parallel_points: ClassVar[ParallelDeclarations] = ParallelDeclarations()

    def __init__(
        self,
        components: dict[str, Any],
        device: torch.device,
        model: ModelInfo,
        *,
        show_progress: bool = True,
        parallel: ParallelContext | None = None,  # None: one rank
        offload: str = "none",  # what waits in host memory until its stage (pipelines/offload.py)
        offload_experts: bool | None = None,  # the inactive expert in host memory (two-expert families)
    ):
        self.parallel = parallel
        self.model = model
        self.device = device
        self.show_progress = show_progress
        self.offload_experts = offload_experts
        self.transformer = components["transformer"].to(device).eval()
        self.vae = components["vae"].eval()
        encoder = components.get("image_encoder")
        self.image_encoder = encoder.eval() if encoder is not None else None
        text = self.load_text_encoders(components)
        self.text_modules = tuple(text)
        modules = {**text, "image_encoder": self.image_encoder, "vae": self.vae}
        self.offload = ComponentOffload(modules, device, offload)

    # -- the family's parts ------------------------------------------------------------------------------------
    @abstractmethod
    def load_text_encoders(self, components: dict[str, Any]) -> dict[str, nn.Module]:
        """Keep the tokenizers and text encoders; return the encoders by component name (offloaded together)."""

    @abstractmethod
    def encode_prompt(self, text: str, request: ResolvedRequest) -> Any:
        """One prompt's text conditioning, as the step's `noise` takes it."""

    @abstractmethod
    def predict_noise(self, latents: torch.Tensor, t: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The guided prediction for one step: the family's model input, through :meth:`guided`."""

    @abstractmethod
    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The denoised latents as the VAE decodes them."""

    @abstractmethod
    def stages(self, control: StepControl | None) -> list[Stage]:
        """The family's stages in the order of its algorithm (:meth:`denoise_stage` reports to `control`)."""

    def new_batch(self, request: ResolvedRequest) -> Batch:
        return Batch(request=request, do_cfg=is_guided(request))

    # -- the shared stages ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, batch: Batch) -> None:
        req = batch.request
        encode = functools.partial(self.encode_prompt, request=req)
        with self.offload.on_device(*self.text_modules):
            if self.parallel is not None:  # under CFG parallelism each half encodes only its branch's text
                negative = (req.negative_prompt or "") if batch.do_cfg else None
                batch.prompt_embeds, batch.negative_prompt_embeds = self.parallel.encode_text(
                    encode, req.prompt, negative
                )
                return
            batch.prompt_embeds = encode(req.prompt)
            if batch.do_cfg:
                batch.negative_prompt_embeds = encode(req.negative_prompt or "")

    def prepare_timesteps(self, batch: Batch) -> None:
        scheduler = request_scheduler(self.model, batch.request, self.device, linear_sigmas=self.linear_sigmas)
        batch.scheduler = scheduler
        batch.timesteps = scheduler.timesteps

    def prepare_latents(self, batch: Batch) -> None:
        # drawn on a CPU generator seeded by the request: every rank draws the same noise, no broadcast
        generator = torch.Generator("cpu").manual_seed(batch.request.seed)
        batch.latents = randn_tensor(
            self.model.latent_shape(batch.request), generator=generator, device=self.device, dtype=torch.float32
        )

    def guided(self, noise: Callable[[Any], torch.Tensor], batch: Batch, scale: float) -> torch.Tensor:
        """Classifier-free guidance over `noise(text conditioning)`: uncond + scale * (cond - uncond), or cond alone
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
    def denoise(self, batch: Batch, control: StepControl | None = None) -> None:
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

    def denoise_stage(self, control: StepControl | None) -> Callable[[Batch], None]:
        return lambda batch: self.denoise(batch, control)

    @torch.no_grad()
    def decode(self, batch: Batch) -> None:
        assert batch.latents is not None
        latents = self.unscale_latents(batch.latents.to(self.device, dtype=self.vae.dtype))
        with self.offload.on_device("vae"):
            if self.parallel is not None:  # every rank decodes a band of rows; the video lands on rank 0 only
                batch.video = self.parallel.decode(latents)
            else:
                batch.video = self.vae.decode(latents, return_dict=False)[0]

    def to_frames(self, batch: Batch) -> None:
        if batch.video is None:  # a rank that does not hold the output
            return
        video = (batch.video[0].float() / 2 + 0.5).clamp(0, 1)  # (C, T, H, W) in [0, 1]
        frames = video.permute(1, 2, 3, 0).mul(255).round().to(torch.uint8)
        batch.frames = frames.cpu().numpy()

    def computed_once(self, compute: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Tensors every rank needs alike (the image conditioning): computed here on one rank; with several, on rank 0
        and broadcast (bit-identical everywhere, and the other ranks do not repeat the encode)."""
        if self.parallel is None:
            return compute()
        return self.parallel.computed_once(compute)

    # -- driver ----------------------------------------------------------------------------------------------
    def __call__(self, request: ResolvedRequest, control: StepControl | None = None) -> Batch:
        """Run the family's stages for a request whose fields are resolved (ModelInfo.resolve_request); `control`
        reports progress and may stop the request between denoising steps."""
        return self.run_stages(self.new_batch(request), self.stages(control))

    def run_stages(self, batch: Batch, stages: Sequence[Stage]) -> Batch:
        for name, stage in stages:
            with self._timed(batch, name):
                stage(batch)
        assert batch.timesteps is not None
        record_per_step_denoising(batch.timings, len(batch.timesteps))
        return batch

    @contextmanager
    def _timed(self, batch: Batch, name: str) -> Iterator[None]:
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
