"""Which replica runs which items: deterministic, balanced by expected cost (frames x pixels x steps)."""

from __future__ import annotations

from collections.abc import Sequence

from distvideo.batch.items import BatchItem


def assign(items: Sequence[BatchItem], replicas: int) -> list[list[BatchItem]]:
    """Longest processing time first: the costliest item goes to the replica with the least work so far (ties: the
    lower index, the lower replica). Each replica's items run in input order. The same items always give the same
    assignment."""
    loads = [0] * replicas
    shares: list[list[BatchItem]] = [[] for _ in range(replicas)]
    for item in sorted(items, key=lambda i: (-i.cost, i.index)):
        replica = min(range(replicas), key=lambda r: (loads[r], r))
        loads[replica] += max(item.cost, 1)
        shares[replica].append(item)
    return [sorted(share, key=lambda i: i.index) for share in shares]
