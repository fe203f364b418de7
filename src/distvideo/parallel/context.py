"""What a pipeline asks of the parallel layout: which texts this rank encodes, the CFG branches of a step, and the
decode. The worker builds one ParallelContext per rank (world size > 1) and applies its plans to the components.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from distvideo.models.plans import ModulePlan
from distvideo.parallel.cfg import cfg_parallel_noise, texts_for_branch
from distvideo.parallel.collectives import broadcast_tensors
from distvideo.parallel.groups import ParallelGroups
from distvideo.parallel.layout import ParallelLayout
from distvideo.parallel.ring import RingAttention
from distvideo.parallel.ulysses import SequencePoints, UlyssesPlan
from distvideo.parallel.vae import MIN_BAND_ROWS, BandedVaeDecoder, VaeBands

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelDeclarations:
    """What a family declares for the parallel plans (its pipeline class's `parallel_points`): where Ulysses hooks its
    transformer (None: sequence parallelism refused when the plan applies), how its VAE is banded (None: decoded
    whole on the replica's first rank), and the plan that projects the text side of its cross-attention once per
    request under sequence parallelism (`text_memo(counts, component=name)`; None: its text changes in every block)."""

    sequence: SequencePoints | None = None
    vae_bands: VaeBands | None = None
    banded_vae: str | None = None  # the VAE class `vae_bands` is proven exact for (another decodes on one rank)
    text_memo: Callable[..., ModulePlan] | None = None


class ParallelContext:
    """One rank's view of the layout: its process groups, the plans for its modules, and the parallel versions of
    the pipeline stages that need them (text encoding, CFG branches, decode).

    Every rank encodes the texts it needs itself (under CFG parallelism only its branch's): no communication. A
    broadcast from rank 0 measured slower under cfg=2 and equal under sp=2 (docs/parallel.md)."""

    def __init__(self, groups: ParallelGroups, *, device: torch.device, min_band_rows: int = MIN_BAND_ROWS):
        self.groups = groups
        self.layout = groups.layout
        self.rank = groups.rank
        self.device = device
        self.counts: Counter[str] = Counter()
        self.ulysses = self._sequence_plan("transformer") if self.layout.sp_enabled else None
        # the decode spans this rank's replica: band index = the rank's place in it, the video lands on its first rank
        self.vae_decoder = BandedVaeDecoder(
            groups.prefix_group, groups.replica_rank, self.layout.replica_size, min_band_rows
        )
        self._told_duplicate = False

    @classmethod
    def create(
        cls, layout: ParallelLayout, *, device: torch.device, timeout: timedelta | None = None
    ) -> ParallelContext:
        """Create the layout's process groups (collective: every rank calls it, once)."""
        return cls(ParallelGroups.create(layout, device_type=device.type, timeout=timeout), device=device)

    def plans(self, transformers: Sequence[str], declared: ParallelDeclarations) -> list[ModulePlan]:
        """Ulysses on every denoising transformer at the family's declared points (sp > 1; a second expert gets its
        own plan, counting into the first's counters) with the family's text-projection memo (SP does not split the text
        side of cross-attention: project it once per request, not once per step), and the banded decode on the VAE as the
        family declares it."""
        plans: list[ModulePlan] = []
        if self.ulysses is not None:
            for name in transformers:
                ulysses = self.ulysses
                if name != ulysses.component:
                    ulysses = self._sequence_plan(name, self.ulysses)
                ulysses.points = declared.sequence
                plans.append(ulysses)
                if declared.text_memo is not None:
                    plans.append(declared.text_memo(self.counts, component=name))
        self.vae_decoder.bands, self.vae_decoder.banded_vae = declared.vae_bands, declared.banded_vae
        plans.append(self.vae_decoder)
        return plans

    def shard_plans(self, mode: str, components: dict[str, Any], transformers: Sequence[str]) -> list[ModulePlan]:
        """`--shard-weights mode` over the ranks of this rank's replica (parallel/shard.py); none for replicas of one
        rank, which have nothing to share."""
        from distvideo.parallel.shard import shard_plans

        mesh = self.groups.replica_device_mesh()
        if mesh is None:
            if mode != "none":
                logger.info("--shard-weights %s: every replica is one rank, nothing to shard", mode)
            return []
        return shard_plans(mode, components, transformers, mesh)

    def _sequence_plan(self, component: str, first: UlyssesPlan | None = None) -> UlyssesPlan:
        """The sequence-parallel plan of one transformer: Ulysses over ``sp``, or USP (Ulysses over ``ulysses``,
        ring attention over ``ring``). A second expert's plan counts into the `first` one's counters."""
        groups, layout = self.groups, self.layout
        counts = first.counts if first is not None else None
        ring = None
        if layout.ring_enabled:
            ring_counts = first.ring.counts if first is not None and first.ring is not None else None
            ring = RingAttention(groups.ring, layout.ring_size, groups.ring_rank, ring_counts)
        return UlyssesPlan(
            groups.sp,
            layout.sp_size,
            groups.sp_rank,
            component=component,
            counts=counts,
            ulysses_group=groups.ulysses,
            ulysses_size=layout.ulysses_size,
            ring=ring,
        )

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
        want_prompt, want_negative = (True, do_cfg)
        if self.cfg_parallel:
            want_prompt, want_negative = texts_for_branch(self.groups.cfg_rank, do_cfg)
        return (
            encode(prompt) if want_prompt else None,
            encode(negative_prompt) if want_negative and negative_prompt is not None else None,
        )

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

    # -- image conditioning --------------------------------------------------------------------------------
    def computed_once(self, compute: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """`compute()` on the first rank of this rank's replica only, its tensors broadcast over the replica: the image
        conditioning (CLIP tokens, the VAE encode of the given frame), which every rank of the replica needs whole and
        alike. Replicas run different requests, so the broadcast never leaves the replica. Measured against every rank
        computing it itself: benchmarks/conditioning.py, docs/families.md."""
        if self.layout.replica_size == 1:
            return compute()  # a replica of one rank: nobody to share with
        if self.groups.replica_rank == 0:
            self.counts["conditioning_computed"] += 1
            return broadcast_tensors(compute(), group=self.groups.replica, device=self.device)
        self.counts["conditioning_received"] += 1
        return broadcast_tensors(None, group=self.groups.replica, device=self.device)

    # -- decoding ------------------------------------------------------------------------------------------
    @property
    def replica_group(self) -> object:
        """The CPU group of this rank's replica: the ranks that run a request together."""
        return self.groups.replica_cpu

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """The decoded video on the replica's first rank (None elsewhere), every rank of the replica decoding a band
        of rows."""
        return self.vae_decoder.decode(latents)
