"""What the Wan families beyond Wan2.1 text-to-video share: running a list of named, timed stages, and a denoising
loop that reports every step to the caller's `control` (progress and cancellation).

Each family's ``__call__`` lists its stages in the order of its algorithm, so the list reads as that algorithm; the
stages themselves are the Wan2.1 ones (text encoding, timesteps, noise, decode, frames) plus the family's own
(image conditioning, the expert switch inside ``predict_noise``, per-token timesteps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from distvideo.pipelines.wan import WanBatch, WanT2VPipeline


class StepControl(Protocol):
    """What a denoising loop reports to: `after_step(done, total)` after each step (it may raise to stop)."""

    def after_step(self, done: int, total: int) -> None: ...


Stage = tuple[str, Callable[[Any], None]]


class StagedWanPipeline(WanT2VPipeline):
    """A Wan pipeline whose ``__call__`` is a list of stages; ``predict_noise`` is the family's step."""

    def run_stages(self, batch: WanBatch, stages: Sequence[Stage]) -> WanBatch:
        for name, stage in stages:
            with self._timed(batch, name):
                stage(batch)
        assert batch.timesteps is not None
        batch.timings["per_step_denoising"] = batch.timings["denoising"] / max(1, len(batch.timesteps))
        return batch

    @torch.no_grad()
    def denoise(self, batch: WanBatch, control: StepControl | None = None) -> None:  # type: ignore[override]
        assert batch.latents is not None and batch.timesteps is not None
        latents = batch.latents
        total = len(batch.timesteps)
        with self._progress(total) as bar:
            for i, t in enumerate(batch.timesteps):
                noise_pred = self.predict_noise(latents, t, batch)
                latents = batch.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
                bar.update()
                if control is not None:
                    control.after_step(i + 1, total)
        batch.latents = latents

    def denoise_stage(self, control: StepControl | None) -> Callable[[WanBatch], None]:
        return lambda batch: self.denoise(batch, control)

    def computed_once(self, compute: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Tensors every rank needs alike (the image conditioning): computed here on one rank; with several, on rank 0
        and broadcast (bit-identical everywhere, and the other ranks do not repeat the encode)."""
        if self.parallel is None:
            return compute()
        return self.parallel.computed_once(compute)
