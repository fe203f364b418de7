"""LoRA on sharded weights: where a merge writes a parameter that FSDP2 (`--shard-weights`, parallel/shard.py) holds
as a DTensor sharded on dim 0, of which this rank keeps some rows. lora/layers.py writes every parameter through
`local_rows`, with or without sharding, so there is one merge and one unmerge."""

from __future__ import annotations

import torch
from torch import nn


def shard_rows(rows: int, ranks: int, index: int) -> tuple[int, int]:
    """The rows [start, stop) of a dimension of `rows` that rank `index` of `ranks` holds under a Shard(0) placement
    (FSDP2's): torch.chunk's split, chunks of ceil(rows / ranks) rows, the last ranks' short or empty."""
    chunk = -(-rows // ranks)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """The tensor a merge writes for `param`, and which rows of the full parameter it holds: the parameter itself and
    all its rows, or for a DTensor sharded on dim 0 (FSDP2's fully_shard) this rank's local shard (a view FSDP gathers
    from) and its rows. Anything else sharded is refused rather than written wrongly."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, Shard

        if isinstance(param, DTensor):
            mesh, placements = param.device_mesh, tuple(param.placements)
            if mesh.ndim != 1 or placements != (Shard(0),):
                raise RuntimeError(
                    f"LoRA on a parameter placed as {placements} over a {mesh.ndim}-D mesh: only Shard(0) over one "
                    "mesh dimension (FSDP2's fully_shard, --shard-weights) is supported"
                )
            local = param.to_local()
            start, stop = shard_rows(param.shape[0], mesh.size(), mesh.get_local_rank())
            if local.shape[0] != stop - start:
                raise RuntimeError(
                    f"LoRA: this rank's shard of a parameter of shape {tuple(param.shape)} has {local.shape[0]} rows; "
                    f"rank {mesh.get_local_rank()} of {mesh.size()} should hold rows {start}:{stop} (torch.chunk)"
                )
            return local, slice(start, stop)
    return param, slice(0, param.shape[0])


def reshard(model: nn.Module) -> None:
    """Register every FSDP2-sharded module's parameters as their shards again, so that a merge writes the shards the
    next forward gathers from. A module can be left gathered: FSDP2 keeps the root's own parameters gathered after a
    forward when `reshard_after_forward` is left to its default (ShardPlan passes True), and `unshard()` gathers any;
    a write to that gathered copy would be dropped at the next reshard. A no-op without sharding."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
