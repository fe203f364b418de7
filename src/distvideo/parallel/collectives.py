"""The one wrapper every collective of ours runs in: a failure surfaces as CollectiveError, a type the executors decide
on (a broken process group), instead of the backend's own (gloo raises plain RuntimeErrors, NCCL DistBackendErrors).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from distvideo.errors import CollectiveError


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Run collectives (or waits on them) inside; any failure is re-raised as CollectiveError naming `what`."""
    try:
        yield
    except CollectiveError:
        raise
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(f"{what}: {type(exc).__name__}: {exc}") from exc


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)


def broadcast_tensors(
    tensors: Sequence[torch.Tensor] | None, *, group: dist.ProcessGroup, device: torch.device
) -> list[torch.Tensor]:
    """The `tensors` of `group`'s first rank on every rank of `group` (the others pass None): their count, dtypes and
    shapes first (one small header), then each tensor. Bit-identical copies everywhere. The group is named, never the
    default one: a replica must not hear another replica's broadcast."""
    with collective("a broadcast of tensors from the group's first rank"):
        if tensors is not None:
            tensors = [t.contiguous() for t in tensors]
            fields = [len(tensors)]
            for t in tensors:
                fields += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
            header = torch.tensor(fields, dtype=torch.int64, device=device)
            length = torch.tensor([header.numel()], dtype=torch.int64, device=device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=device)
        dist.broadcast(length, group_src=0, group=group)
        if tensors is None:
            header = torch.empty(int(length.item()), dtype=torch.int64, device=device)
        dist.broadcast(header, group_src=0, group=group)
        if tensors is None:
            fields, tensors, i = header.tolist(), [], 1
            for _ in range(fields[0]):
                dtype, ndim = _DTYPES[fields[i]], fields[i + 1]
                tensors.append(torch.empty(fields[i + 2 : i + 2 + ndim], dtype=dtype, device=device))
                i += 2 + ndim
        for t in tensors:
            dist.broadcast(t, group_src=0, group=group)
    return list(tensors)
