"""Ring attention: the sequence-parallel share that Ulysses cannot take (USP, ``sp = ulysses x ring``).

After Ulysses' all-to-all (or directly, without Ulysses) every rank of a ring group holds the queries, keys and values
of one contiguous chunk of the padded sequence, for its heads. Each rank attends its queries to its own key/value
chunk, then passes the chunk to the next rank of the ring and receives the previous one's, with point-to-point
sends (``batch_isend_irecv``: gloo on CPU, NCCL on GPUs) posted before the block's attention so the transfer overlaps
it. After ``ring_size`` blocks every query has seen every key; the partial results are merged with their log-sum-exp,
in float32, so the result equals full attention up to float rounding. Padded keys (the padding sits at the end of
the sequence, so in the last chunks) are cut off each block before attention and never take part.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from distvideo.models import compat
from distvideo.parallel.collectives import collective


def merge_partials(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attentions of the same queries over disjoint key sets: outputs (B, S, H, D) and LSEs (B, S, H), all
    float32. `out`/`lse` None: nothing merged yet."""
    if out is None or lse is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
    return out, merged


def real_keys(seq_len: int, chunk_len: int, source: int) -> int:
    """How many keys of ring rank `source`'s chunk are real (not padding) in a sequence of `seq_len` tokens."""
    return max(0, min(chunk_len, seq_len - source * chunk_len))


class RingAttention:
    """Attention of this rank's query chunk against every chunk of the ring group `group` (group rank = ring_rank).
    `counts` records the point-to-point passes ("ring_pass": one per block but the last)."""

    def __init__(self, group: Any, ring_size: int, ring_rank: int, counts: Counter[str] | None = None):
        if ring_size < 2 or not 0 <= ring_rank < ring_size:
            raise ValueError(
                f"ring attention needs ring_size >= 2 and 0 <= ring_rank < ring_size, got {ring_size}, {ring_rank}"
            )
        self.group = group
        self.ring_size = ring_size
        self.ring_rank = ring_rank
        self.counts: Counter[str] = counts if counts is not None else Counter()

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_len: int) -> torch.Tensor:
        """(B, C, H, D) chunks of this rank (C = padded length / ring_size) -> the attention output (B, C, H, D) in
        the query's dtype; `seq_len`: the real tokens of the whole sequence (the padded keys are left out)."""
        out, _ = self.partials(query, key, value, seq_len)
        return out.to(query.dtype)

    def partials(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring's attention of `query` (any number of queries) over every chunk's real keys, unnormalised for
        merging: (output (B, S_q, H, D), LSE (B, S_q, H)), both float32 (HunyuanVideo's joint attention merges its
        text keys in after)."""
        chunk_len = key.shape[1]
        kv = torch.stack([key, value]).contiguous()
        out: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        for step in range(self.ring_size):
            source = (self.ring_rank - step) % self.ring_size  # whose chunk `kv` holds now
            pending, incoming = self._pass_on(kv) if step < self.ring_size - 1 else (None, None)
            real = real_keys(seq_len, chunk_len, source)
            if real > 0:  # a chunk of padding only adds nothing
                block_out, block_lse = compat.attention_with_lse(query, kv[0][:, :real], kv[1][:, :real])
                out, lse = merge_partials(out, lse, block_out, block_lse)
            if pending is not None and incoming is not None:
                with collective("a ring attention key/value pass"):
                    for request in pending:
                        request.wait()
                kv = incoming
        assert out is not None and lse is not None, "the first chunk always holds real keys"
        return out, lse

    def _pass_on(self, kv: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
        """Post the send of `kv` to the next ring rank and the receive of the previous one's; returns the requests
        and the buffer being filled."""
        incoming = torch.empty_like(kv)
        ops = [
            dist.P2POp(dist.isend, kv, group=self.group, group_peer=(self.ring_rank + 1) % self.ring_size),
            dist.P2POp(dist.irecv, incoming, group=self.group, group_peer=(self.ring_rank - 1) % self.ring_size),
        ]
        with collective("a ring attention key/value pass"):
            requests = dist.batch_isend_irecv(ops)
        self.counts["ring_pass"] += 1
        return requests, incoming
