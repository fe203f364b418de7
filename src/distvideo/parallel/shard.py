"""Sharded weights: FSDP2 (`torch.distributed.fsdp.fully_shard`) over the ranks of one replica.

`--shard-weights transformer` shards each denoising transformer block by block: every rank of the replica holds a
1/N slice of each block's parameters between steps; a block's full parameters are all-gathered just before its
forward (the next block's gather is issued then too: `set_modules_to_forward_prefetch`) and freed after it, and the
parameters outside the blocks (embeddings, the output head) are gathered for the transformer's whole forward.
`all` shards the text encoders too (by their layers, transformers' `_no_split_modules`), which every rank runs in
lockstep. The image encoder is not sharded: one rank computes the image conditioning and broadcasts it
(`ParallelContext.computed_once`), and FSDP needs every rank of the group in every forward. The VAE is small and
decodes in bands on every rank (parallel/vae.py).

The ranks of a replica run the same blocks in the same order (sequence parallel: their own tokens; CFG parallel:
their own guidance branch), which is what FSDP's collectives need. The gathered parameters are the unsharded ones
bit for bit, so the frames equal the unsharded run's (tests/test_shard_weights.py).

FSDP2 has no public way to take itself off a module: the plan's undo leaves the module sharded (the worker drops it
at shutdown).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distvideo.models.plans import ModulePlan, Undo

logger = logging.getLogger(__name__)


def block_classes(module: nn.Module) -> tuple[str, ...]:
    """The class names of the module's repeated blocks: diffusers' `_repeated_blocks`, transformers'
    `_no_split_modules`."""
    for attribute in ("_repeated_blocks", "_no_split_modules"):
        names = getattr(module, attribute, None)
        if names:
            return tuple(str(name) for name in names)
    return ()


@dataclass
class ShardPlan:
    """fully_shard of each repeated block of `component`, then of the component itself, over `mesh` (1-D: the
    ranks of this rank's replica)."""

    component: str
    mesh: DeviceMesh
    name: ClassVar[str] = "shard-weights"

    def apply(self, module: nn.Module) -> Undo:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        classes = block_classes(module)
        blocks = [m for m in module.modules() if type(m).__name__ in classes and m is not module]
        if not blocks:
            raise TypeError(
                f"{self.component} ({type(module).__name__}) names no repeated blocks to shard "
                "(diffusers' _repeated_blocks, transformers' _no_split_modules)"
            )
        depth = {id(m): name.count(".") for name, m in module.named_modules()}
        for block in sorted(blocks, key=lambda m: -depth[id(m)]):  # inner blocks first: FSDP nests outward
            fully_shard(block, mesh=self.mesh, reshard_after_forward=True)
        fully_shard(module, mesh=self.mesh, reshard_after_forward=True)
        main = [b for b in blocks if type(b).__name__ == classes[0]]
        for block, following in itertools.pairwise(main):
            if isinstance(block, FSDPModule) and isinstance(following, FSDPModule):
                block.set_modules_to_forward_prefetch([following])
        logger.debug("%s: %d block(s) sharded over %d ranks", self.component, len(blocks), self.mesh.size())

        def undo() -> None:  # FSDP2 cannot be taken off; the module stays sharded until the worker drops it
            return None

        return undo


def gathered_bytes(module: nn.Module) -> int:
    """The bytes of full parameters a rank holds at once while the sharded `module` runs: its two largest blocks
    (the running one and the prefetched next) and its own parameters outside the blocks (gathered for the whole
    forward). 0 for a module that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return 0
    classes = block_classes(module)
    blocks = [m for m in module.modules() if type(m).__name__ in classes and m is not module]
    inside = {id(p) for block in blocks for p in block.parameters()}
    sizes = sorted((sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks), reverse=True)
    root = sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in inside)
    return root + sum(sizes[:2])


def shard_plans(
    mode: str, components: dict[str, Any], transformers: Sequence[str], mesh: DeviceMesh
) -> list[ModulePlan]:
    """The plans `--shard-weights mode` applies: each denoising transformer; with "all", every text encoder too."""
    if mode == "none":
        return []
    names = list(transformers)
    if mode == "all":
        names += [name for name in components if name.startswith("text_encoder") and components[name] is not None]
    return [ShardPlan(name, mesh) for name in names]
