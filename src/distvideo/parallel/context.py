"""What a pipeline asks of the parallel layout: which texts this rank encodes, the CFG branches of a step, and the
decode. The worker builds one ParallelContext per rank (world size > 1) and applies its plans to the components.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from distvideo.config import EngineConfig
from distvideo.parallel.cfg import cfg_parallel_noise, texts_for_branch
from distvideo.parallel.groups import ParallelGroups
from distvideo.parallel.layout import resolve_layout
from distvideo.parallel.text_cache import memoize_text_projections
from distvideo.parallel.ulysses import UlyssesPlan
from distvideo.parallel.vae import MIN_BAND_ROWS, BandedVaeDecoder

logger = logging.getLogger(__name__)

TextEncoding = Literal["local", "broadcast"]

#: "local": every rank encodes the texts it needs (under CFG parallelism only its branch's text): no communication,
#: but every rank holds the text encoder. "broadcast": rank 0 encodes, the embeddings are broadcast. Local measured
#: faster under cfg=2 and equal under sp=2 (docs/parallel.md), so it is the default.
DEFAULT_TEXT_ENCODING: TextEncoding = "local"


class ParallelContext:
    """One rank's view of the layout: its process groups, the plans applied to its modules, and the parallel
    versions of the pipeline stages that need them (text encoding, CFG branches, decode)."""

    def __init__(
        self,
        groups: ParallelGroups,
        *,
        device: torch.device,
        text_encoding: TextEncoding = DEFAULT_TEXT_ENCODING,
        min_band_rows: int = MIN_BAND_ROWS,
    ):
        self.groups = groups
        self.layout = groups.layout
        self.rank = groups.rank
        self.device = device
        self.text_encoding: TextEncoding = text_encoding
        self.counts: Counter[str] = Counter()
        self.ulysses: UlyssesPlan | None = None
        self.vae_decoder = BandedVaeDecoder(groups.prefix_group, groups.rank, self.layout.world_size, min_band_rows)
        self._told_duplicate = False

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        *,
        world_size: int,
        num_heads: int | None,
        device: torch.device,
        timeout: timedelta | None = None,
    ) -> ParallelContext:
        """Resolve the layout and create its process groups (collective: every rank calls it, once)."""
        layout = resolve_layout(
            world_size, sp_size=config.sp_size, cfg_parallel=config.cfg_parallel, num_heads=num_heads
        )
        return cls(ParallelGroups.create(layout, timeout=timeout), device=device)

    def apply_plans(self, components: dict[str, Any]) -> None:
        """Change the loaded modules in place: Ulysses on the transformer (sp > 1), banded decode on the VAE."""
        if self.layout.sp_enabled:
            self.ulysses = UlyssesPlan(self.groups.sp, self.layout.sp_size, self.groups.sp_rank)
            self.ulysses.apply(components["transformer"])
            # SP does not split the text side of cross-attention: project it once per request, not once per step
            memoize_text_projections(components["transformer"], self.counts)
        self.vae_decoder.apply(components["vae"])
        logger.debug("rank %d: %s", self.rank, self.layout.describe())

    @property
    def cfg_parallel(self) -> bool:
        return self.layout.cfg_enabled

    # -- text encoding -------------------------------------------------------------------------------------
    def encode_text(
        self, encode: Callable[[str], torch.Tensor], prompt: str, negative_prompt: str | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(prompt embeddings, negative embeddings) this rank needs; `negative_prompt` None: no guidance.

        An entry is None where this rank's CFG half does not need it.
        """
        do_cfg = negative_prompt is not None
        if self.text_encoding == "broadcast":
            return self._encode_and_broadcast(encode, prompt, negative_prompt)
        want_prompt, want_negative = (True, do_cfg)
        if self.cfg_parallel:
            want_prompt, want_negative = texts_for_branch(self.groups.cfg_rank, do_cfg)
        return (
            encode(prompt) if want_prompt else None,
            encode(negative_prompt) if want_negative and negative_prompt is not None else None,
        )

    def _encode_and_broadcast(
        self, encode: Callable[[str], torch.Tensor], prompt: str, negative_prompt: str | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        box: list[Any] = [None]
        if self.rank == 0:
            embeds = [encode(prompt), encode(negative_prompt) if negative_prompt is not None else None]
            box = [[(e.shape, e.dtype) if e is not None else None for e in embeds]]
        dist.broadcast_object_list(box, src=0, group=self.groups.world_cpu)  # shapes and dtypes
        if self.rank != 0:
            embeds = [torch.empty(meta[0], dtype=meta[1], device=self.device) if meta else None for meta in box[0]]
        for tensor in embeds:
            if tensor is not None:
                dist.broadcast(tensor, src=0, group=self.groups.world)
        self.counts["text_broadcast"] += 1
        return embeds[0], embeds[1]

    # -- denoising -----------------------------------------------------------------------------------------
    def cfg_branches(
        self,
        noise: Callable[[torch.Tensor], torch.Tensor],
        prompt_embeds: torch.Tensor | None,
        negative_embeds: torch.Tensor | None,
        do_cfg: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(conditional, unconditional or None) predictions of one step under CFG parallelism."""
        if not do_cfg and not self._told_duplicate:
            if self.rank == 0:
                logger.info(
                    "guidance is off (guidance_scale <= 1) on a CFG-parallel layout (%s): both halves run the "
                    "conditional branch, so half the ranks duplicate work; launch with cfg_parallel=False for such "
                    "requests",
                    self.layout.describe(),
                )
            self._told_duplicate = True
        return cfg_parallel_noise(
            noise,
            prompt_embeds,
            negative_embeds,
            do_cfg=do_cfg,
            cfg_rank=self.groups.cfg_rank,
            group=self.groups.cfg,
            counts=self.counts,
        )

    # -- decoding ------------------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """The decoded video on rank 0 (None elsewhere), every rank of the world decoding a band of rows."""
        return self.vae_decoder.decode(latents)
