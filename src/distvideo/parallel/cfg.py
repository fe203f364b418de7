"""CFG parallelism: the conditional and unconditional branches run on the two halves of the world.

Each rank runs one branch of every step; one all-gather over its CFG pair brings the other branch, so every rank
holds both predictions, applies the same guidance and the same scheduler step, and the latents stay identical
everywhere. (Without CFG parallelism the branches run one after the other, as on one rank: batching them into one
forward would halve the collectives per step but doubles the activations; see docs/parallel.md.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distvideo.parallel.collectives import collective

COND, UNCOND = 0, 1  # cfg_rank of each branch (rank = cfg_rank * sp_size + sp_rank)


def texts_for_branch(cfg_rank: int, do_cfg: bool) -> tuple[bool, bool]:
    """(encode the prompt, encode the negative prompt) on a rank of CFG half `cfg_rank`."""
    if not do_cfg:
        return True, False  # without guidance both halves run the conditional branch
    return cfg_rank == COND, cfg_rank == UNCOND


def cfg_parallel_noise(
    noise: Callable[[torch.Tensor], torch.Tensor],
    prompt_embeds: torch.Tensor | None,
    negative_embeds: torch.Tensor | None,
    *,
    do_cfg: bool,
    cfg_rank: int,
    group: Any,
    counts: Counter[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(conditional, unconditional or None) noise predictions; this rank computes one, the all-gather over `group`
    (the ``cfg`` dimension of the layout's mesh, group rank = cfg_rank) the other."""
    if not do_cfg:
        assert prompt_embeds is not None
        return noise(prompt_embeds), None
    embeds = prompt_embeds if cfg_rank == COND else negative_embeds
    assert embeds is not None, "this CFG half did not encode the text of its branch"
    local = noise(embeds).contiguous()
    both = [torch.empty_like(local), torch.empty_like(local)]
    with collective("the CFG all-gather"):
        dist.all_gather(both, local, group=group)  # group rank = cfg_rank: [cond, uncond]
    if counts is not None:
        counts["cfg_all_gather"] += 1
    return both[COND], both[UNCOND]
