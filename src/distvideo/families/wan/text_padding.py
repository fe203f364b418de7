"""The text side of Wan's cross-attention, computed once and without its padding: two exact plans that share a cache.

Wan pads every text embedding to 512 tokens with zero rows, and its cross-attention attends to all 512 keys. A
short prompt (a few dozen tokens at most) thus spends almost all of each cross-attention, and
of the text projections, on identical padding keys. Identical keys with identical values are one key counted r
times:

    softmax over [k_1 .. k_L, k_p x r]  ==  softmax over [k_1 .. k_L, k_p] with log(r) added to the last logit,

and the weighted sum of the values is the same. So the plan

- (model pre-hook) finds the trailing run of r identical rows of ``encoder_hidden_states`` (the zero padding) and,
  when it pays, keeps the real rows plus ONE padding row: the text embedder and every cross-attention's key and
  value projections then run on L + 1 rows instead of 512;
- (``attn2`` processor) attends to those L + 1 keys with ``log(r)`` added to the padding key's logit, in float32
  (so no low-precision rounding of the bias).

The frames equal the uncompacted ones up to float rounding (the parity tests check them against diffusers'
WanPipeline, max abs difference 2 on uint8). Image-conditioned models (Wan I2V: ``add_k_proj``) are
left alone. The compacted input tensor is cached on the identity of the original one, so a request's embeddings
keep one identity across steps, which the second plan relies on:

**TextProjectionMemo** (applied under sequence parallelism). The text embeddings of a request do not change between
steps, yet every forward projects them again: the text embedder, then the key and value projections of every
cross-attention. Under sequence parallelism that work is not split (every rank projects all text tokens for all
heads), so its share grows with sp. Memoising those modules on the identity of their input removes it after the
first step: a module returns its previous output while it is called with the very same tensor object, unchanged
(same version counter), outside autograd. A new request brings new tensors, so nothing stale is ever reused.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distvideo.models import compat
from distvideo.models.identity_cache import IdentityCache

#: compact only when at most this fraction of the rows would remain (below it the saving is not worth a processor)
MAX_KEPT_FRACTION = 0.5


def trailing_run(embeds: torch.Tensor) -> int:
    """The number of trailing rows (dim 1) equal to the last row, minimum over the batch; 1 when none repeat."""
    if embeds.ndim != 3 or embeds.shape[1] < 2:
        return 1
    same = (embeds == embeds[:, -1:]).all(dim=-1)  # (B, S)
    differs = (~same).flip(1).int()  # first True from the end = last row that differs
    first = differs.argmax(dim=1)  # index from the end of the first differing row; 0 if none differ
    none_differ = differs.sum(dim=1) == 0
    runs = torch.where(none_differ, torch.full_like(first, embeds.shape[1]), first)
    return int(runs.min())


class CompactTextAttnProcessor:
    """Wan cross-attention (attn2) over compacted text: the last key stands for `plan.copies` identical keys."""

    def __init__(self, plan: TextPaddingPlan, original: Any):
        self.plan = plan
        self.original = original

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Any = None,
    ) -> torch.Tensor:
        copies = self.plan.copies
        if copies <= 1 or encoder_hidden_states is None or attention_mask is not None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = compat.wan_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))  # (B, S, H, D)
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))  # (B, L + 1, H, D)
        value = value.unflatten(2, (attn.heads, -1))
        scale = 1.0 / math.sqrt(query.shape[-1])
        scores = torch.einsum("bshd,bthd->bhst", query.float(), key.float()).mul_(scale)
        scores[..., -1] += math.log(copies)
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bhst,bthd->bshd", probs, value.float()).flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class TextPaddingPlan:
    """Applies the compaction to a WanTransformer3DModel in place (a ModulePlan); `remove()` (the undo `apply`
    returns) undoes it. `copies` is the padding run of the current forward (1: not compacted);
    `counts["compacted_forward"]` counts the forwards it served."""

    name = "text-padding"

    def __init__(self, counts: Counter[str] | None = None, component: str = "transformer"):
        self.counts = counts if counts is not None else Counter()
        self.component = component
        self.copies = 1
        self._handles: list[Any] = []
        self._processors: list[tuple[Any, Any]] = []
        self._cache = IdentityCache(entries=2)  # the two CFG branches' texts

    def apply(self, transformer: Any) -> Callable[[], None]:
        if any(block.attn2.add_k_proj is not None for block in transformer.blocks):
            return self.remove  # image-conditioned: image tokens are concatenated in front of the text, left alone
        self._handles.append(transformer.register_forward_pre_hook(self._on_model_input, with_kwargs=True))
        for block in transformer.blocks:
            original = block.attn2.processor
            self._processors.append((block.attn2, original))
            block.attn2.set_processor(CompactTextAttnProcessor(self, original))
        return self.remove

    @property
    def applied(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for attn, original in self._processors:
            attn.set_processor(original)
        self._handles, self._processors = [], []
        self._cache.clear()
        self.copies = 1

    def compact(self, embeds: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(embeddings to use, padding copies the last row stands for); cached on the tensor's identity."""
        cached = self._cache.get(embeds)
        if cached is not None:
            return cached
        run = trailing_run(embeds)
        seq = embeds.shape[1]
        if run < 2 or (seq - run + 1) > MAX_KEPT_FRACTION * seq:
            out, copies = embeds, 1
        else:
            out, copies = embeds[:, : seq - run + 1], run
        self._cache.put(embeds, (out, copies))
        return out, copies

    def _on_model_input(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if kwargs.get("encoder_hidden_states_image") is not None:
            self.copies = 1
            return None
        if "encoder_hidden_states" in kwargs:
            embeds, where = kwargs["encoder_hidden_states"], None
        elif len(args) > 2:
            embeds, where = args[2], 2
        else:
            self.copies = 1
            return None
        compacted, self.copies = self.compact(embeds)
        if self.copies > 1:
            self.counts["compacted_forward"] += 1
        if where is None:
            return args, {**kwargs, "encoder_hidden_states": compacted}
        return (*args[:where], compacted, *args[where + 1 :]), kwargs


# --- the text-projection memo ---------------------------------------------------------------------------------------
MEMO_ENTRIES = 2  # conditional and unconditional text


class InputMemo:
    """Patches `module.forward` to return the cached output for a repeated input tensor; `remove()` undoes it."""

    def __init__(self, module: nn.Module, counts: Counter[str] | None = None, entries: int = MEMO_ENTRIES):
        self.module = module
        self.counts = counts if counts is not None else Counter()
        self._cache = IdentityCache(entries)
        original: Callable[..., Any] = module.forward

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or not isinstance(x, torch.Tensor) or torch.is_grad_enabled():
                return original(x, *args, **kwargs)
            out = self._cache.get(x)
            if out is not None:
                self.counts["text_projection_reused"] += 1
                return out
            out = original(x)
            self._cache.put(x, out)
            return out

        module.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        del self.module.forward
        self._cache.clear()


class TextProjectionMemo:
    """A ModulePlan: memoise the text embedder and every cross-attention's key and value projections of a
    WanTransformer3DModel (image-conditioned blocks excepted: their image and text tokens are re-concatenated per
    forward). A transformer without Wan's text-only cross-attention (HunyuanVideo 1.5's joint attention, whose text
    stream changes in every block) holds nothing to memoise and is left unchanged."""

    name = "text-projection-memo"

    def __init__(self, counts: Counter[str] | None = None, component: str = "transformer"):
        self.counts = counts if counts is not None else Counter()
        self.component = component

    def apply(self, transformer: Any) -> Callable[[], None]:
        if type(transformer).__name__ != "WanTransformer3DModel":
            return lambda: None
        modules = [transformer.condition_embedder.text_embedder]
        for block in transformer.blocks:
            if block.attn2.add_k_proj is None:
                modules += [block.attn2.to_k, block.attn2.to_v]
        memos = [InputMemo(m, self.counts) for m in modules]

        def undo() -> None:
            for memo in memos:
                memo.remove()

        return undo
