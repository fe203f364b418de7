"""What the Wan families beyond Wan2.1 text-to-video share: running a list of named, timed stages (the denoising
stage is Wan2.1's loop, which reports every step to the caller's `control`: progress and cancellation), and the
image conditioning computed once for every rank.

Each family's ``__call__`` lists its stages in the order of its algorithm, so the list reads as that algorithm; the
stages themselves are the Wan2.1 ones (text encoding, timesteps, noise, decode, frames) plus the family's own
(image conditioning, the expert switch inside ``predict_noise``, per-token timesteps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from distvideo.pipelines.control import StepControl
from distvideo.pipelines.wan import WanBatch, WanT2VPipeline, record_per_step_denoising

Stage = tuple[str, Callable[[Any], None]]


class StagedWanPipeline(WanT2VPipeline):
    """A Wan pipeline whose ``__call__`` is a list of stages; ``predict_noise`` is the family's step."""

    def run_stages(self, batch: WanBatch, stages: Sequence[Stage]) -> WanBatch:
        for name, stage in stages:
            with self._timed(batch, name):
                stage(batch)
        assert batch.timesteps is not None
        record_per_step_denoising(batch.timings, len(batch.timesteps))
        return batch

    def denoise_stage(self, control: StepControl | None) -> Callable[[WanBatch], None]:
        return lambda batch: self.denoise(batch, control)

    def computed_once(self, compute: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Tensors every rank needs alike (the image conditioning): computed here on one rank; with several, on rank 0
        and broadcast (bit-identical everywhere, and the other ranks do not repeat the encode)."""
        if self.parallel is None:
            return compute()
        return self.parallel.computed_once(compute)
