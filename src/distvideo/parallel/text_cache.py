"""Reuse the text-side projections of a Wan transformer across denoising steps.

The text embeddings of a request do not change between steps, yet every forward projects them again: the text
embedder, then the key and value projections of every cross-attention. Under sequence parallelism that work is not
split (every rank projects all text tokens for all heads), so its share grows with sp. Memoising those modules on
the identity of their input removes it after the first step: a module returns its previous output while it is
called with the very same tensor object, unchanged (same version counter), outside autograd. A new request brings
new embedding tensors, so nothing stale is ever reused. Two entries per module cover the two CFG branches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distvideo.models.identity_cache import IdentityCache

ENTRIES = 2  # conditional and unconditional text


class InputMemo:
    """Patches `module.forward` to return the cached output for a repeated input tensor; `remove()` undoes it."""

    def __init__(self, module: nn.Module, counts: Counter[str] | None = None, entries: int = ENTRIES):
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


def memoize_text_projections(transformer: Any, counts: Counter[str] | None = None) -> list[InputMemo]:
    """Memoise the text embedder and every cross-attention's key and value projections of a WanTransformer3DModel."""
    modules = [transformer.condition_embedder.text_embedder]
    for block in transformer.blocks:
        if block.attn2.add_k_proj is not None:
            continue  # image-conditioned: the image and text tokens are re-concatenated per forward
        modules += [block.attn2.to_k, block.attn2.to_v]
    return [InputMemo(m, counts) for m in modules]
