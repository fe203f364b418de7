"""Wan's self-attention (``attn1``) over a sequence sharded by parallel/ulysses.py's plan: the processor Wan's
`SequencePoints` install, and Wan's interleaved rotary embedding."""

from __future__ import annotations

from typing import Any

import torch

from distvideo.models import compat
from distvideo.parallel.ulysses import SequenceAttnProcessor


def apply_wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding, as in diffusers' WanAttnProcessor. In float32/64 as one complex product:
    the same arithmetic without the strided writes of the real version."""
    if x.dtype in (torch.float32, torch.float64) and freqs_cos.dtype == x.dtype and x.stride(-1) == 1:
        rotation = torch.complex(freqs_cos[..., 0::2], freqs_sin[..., 1::2])
        pairs = torch.unflatten(x, -1, (-1, 2))
        return torch.view_as_real(torch.view_as_complex(pairs) * rotation).flatten(-2)
    x1, x2 = torch.unflatten(x, -1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class UlyssesAttnProcessor(SequenceAttnProcessor):
    """Self-attention (attn1) of a Wan block over a sequence sharded across the SP group.

    Mirrors diffusers' WanAttnProcessor for self-attention (no image context), with the two all-to-alls around
    the attention op.
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise RuntimeError("UlyssesAttnProcessor handles self-attention without a mask only (Wan's attn1)")
        query, key, value = compat.wan_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = apply_wan_rotary(query, *rotary_emb)
            key = apply_wan_rotary(key, *rotary_emb)

        plan = self.plan
        if plan.ulysses_size > 1:  # (B, S/sp, H, D) x3 -> (B, S/ring, H/ulysses, D) x3, in one all-to-all
            query, key, value = plan.scatter_heads_gather_sequence(torch.stack([query, key, value]))
        seq_len = plan.shard.seq_len
        if plan.ring is not None:  # this rank's chunk of queries against every chunk of keys, around the ring
            out = plan.ring(query, key, value, seq_len)
        else:
            key, value = key[:, :seq_len], value[:, :seq_len]  # padded keys take no part in attention
            out = compat.dispatch_attention(query, key, value, self._attention_backend)
        if plan.ulysses_size > 1:
            out = plan.scatter_sequence_gather_heads(out)  # (B, S/ring, H/ulysses, D) -> (B, S/sp, H, D)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        projected: torch.Tensor = attn.to_out[1](out)  # attn: diffusers' Attention, not annotated
        return projected
