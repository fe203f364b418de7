"""Ulysses for dual-stream (MMDiT) blocks whose one attention joins the text tokens to the video tokens under a mask:
HunyuanVideo 1.5's ``attn`` (diffusers' HunyuanVideo15AttnProcessor2_0), on parallel/ulysses.py's shared plan.

The video tokens are sharded over sp; the text tokens are whole on every rank. Per layer: the video q, k, v of the
local tokens and all heads go through the plan's one all-to-all (all tokens, heads/sp); the text q, k, v are projected
on every rank and this rank keeps its heads; the joint attention runs over all real video tokens and the text with the
same mask as on one rank (padded video tokens never take part); the video output goes back through the second
all-to-all, and the text output of each rank's heads is all-gathered (the text stream stays whole and identical on
every rank). Under USP (ring attention) the masked attention becomes an unmasked one over the valid text keys, merged
with the ring's video blocks (`_ring_attention`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distvideo.models import compat
from distvideo.parallel.collectives import collective
from distvideo.parallel.ulysses import SequenceAttnProcessor


def joint_attention_mask(text_mask: torch.Tensor, video_len: int) -> torch.Tensor:
    """The (B, 1, S, S) boolean mask HunyuanVideo15AttnProcessor2_0 builds: every video token valid, the text's own
    mask after them; a pair attends when both tokens are valid."""
    valid = F.pad(text_mask, (video_len, 0), value=True).bool()
    batch, seq_len = valid.shape
    rows = valid.view(batch, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
    return rows & rows.transpose(2, 3)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return torch.unflatten(x, 2, (heads, -1))


class JointUlyssesAttnProcessor(SequenceAttnProcessor):
    """HunyuanVideo 1.5's joint attention over video tokens sharded across the Ulysses group (see the module)."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,  # (cos, sin) of this rank's tokens
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is None:
            raise RuntimeError(
                "JointUlyssesAttnProcessor needs the text tokens and their mask (HunyuanVideo 1.5's attn)"
            )
        from diffusers.models.embeddings import apply_rotary_emb

        plan, heads = self.plan, attn.heads
        query = attn.norm_q(_heads(attn.to_q(hidden_states), heads))
        key = attn.norm_k(_heads(attn.to_k(hidden_states), heads))
        value = _heads(attn.to_v(hidden_states), heads)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        # (B, S/sp, H, D) x3 -> (B, S_padded, H/sp, D) x3 in one all-to-all (under USP: this ring rank's chunk)
        if plan.ulysses_size > 1:
            query, key, value = plan.scatter_heads_gather_sequence(torch.stack([query, key, value]))
        video_len = plan.shard.seq_len
        local = heads // plan.ulysses_size
        first = plan.ulysses_rank * local  # the all-to-all gave rank j the heads j * H/ulysses onwards
        text = [
            _heads(proj(encoder_hidden_states), heads)[:, :, first : first + local]
            for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        ]
        text_query, text_key, text_value = text
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)
        if plan.ring is not None:
            video, text_out = self._ring_attention(query, key, value, text_query, text_key, text_value, attention_mask)
            return self._project(attn, video, text_out)
        out = compat.dispatch_attention(
            torch.cat([query[:, :video_len], text_query], dim=1),
            torch.cat([key[:, :video_len], text_key], dim=1),
            torch.cat([value[:, :video_len], text_value], dim=1),
            self._attention_backend,
            attn_mask=joint_attention_mask(attention_mask, video_len),
        ).to(query.dtype)
        video = torch.cat([out[:, :video_len], out.new_zeros(out.shape[0], plan.shard.pad, *out.shape[2:])], dim=1)
        return self._project(attn, video, out[:, video_len:])

    def _project(self, attn: Any, video: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Video (B, S_padded or chunk, H/ulysses, D) back to this rank's tokens and all heads, text (B, L,
        H/ulysses, D) to all heads; then the output projections of both streams."""
        if self.plan.ulysses_size > 1:
            video = self.plan.scatter_sequence_gather_heads(video)  # (B, S/sp, H, D)
            text = self.gather_heads(text)  # (B, L, H, D), whole on every rank
        video = attn.to_out[1](attn.to_out[0](video.flatten(2, 3)))
        return video, attn.to_add_out(text.flatten(2, 3))

    def _ring_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        text_query: torch.Tensor,
        text_key: torch.Tensor,
        text_value: torch.Tensor,
        text_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """USP: this ring rank's video chunk and the valid text tokens as queries, against every chunk's real video
        keys (the ring) and the valid text keys (local, merged by their log-sum-exp). The transformer puts the valid
        text tokens first, so they are a prefix, and a masked key's weight is exactly 0: leaving the padded ones out
        is the masked attention. A padded text token's output (a fully masked query) only ever meets masked
        positions later, so it is left at zero."""
        from distvideo.parallel.ring import merge_partials

        plan = self.plan
        assert plan.ring is not None
        valid = text_mask.bool().sum(dim=1)
        if bool((valid != valid[0]).any()):
            raise RuntimeError("ring attention needs the same number of valid text tokens in every batch row")
        n = int(valid[0])
        chunk = query.shape[1]
        queries = torch.cat([query, text_query[:, :n]], dim=1)
        out, lse = plan.ring.partials(queries, key, value, plan.shard.seq_len)
        if n > 0:
            local_out, local_lse = compat.attention_with_lse(queries, text_key[:, :n], text_value[:, :n])
            out, lse = merge_partials(out, lse, local_out, local_lse)
        out = out.to(query.dtype)
        text = torch.zeros_like(text_query)
        text[:, :n] = out[:, chunk:]
        return out[:, :chunk], text

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's heads (B, L, H/sp, D) -> (B, L, H, D), in the order of the ranks."""
        plan = self.plan
        parts = [torch.empty_like(x) for _ in range(plan.ulysses_size)]
        with collective("the joint attention's text gather"):
            dist.all_gather(parts, x.contiguous(), group=plan.ulysses_group)
        plan.counts["text_head_gather"] += 1
        return torch.cat(parts, dim=2)
