"""Values keyed on the identity of a tensor, valid while the tensor is unchanged.

A request's text embeddings are the same tensor objects for all its denoising steps, so what is derived from them
(a compacted view, a projection) can be reused from the second step on. The key is the tensor object itself (held
weakly) plus its version counter, which every in-place change bumps; inference tensors have no version counter and
are never cached. A new request brings new tensors, so nothing stale is ever returned.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from distvideo.models.compat import tensor_version


class IdentityCache:
    """The newest `entries` (tensor -> value) pairs; `get` returns None for a tensor not held or changed since."""

    def __init__(self, entries: int):
        self.entries = entries
        self._items: list[tuple[weakref.ref[torch.Tensor], int, Any]] = []

    def get(self, x: torch.Tensor) -> Any | None:
        if x.is_inference():
            return None
        for ref, version, value in self._items:
            if ref() is x and tensor_version(x) == version:
                return value
        return None

    def put(self, x: torch.Tensor, value: Any) -> None:
        if not x.is_inference():
            self._items = [(weakref.ref(x), tensor_version(x), value), *self._items[: self.entries - 1]]

    def clear(self) -> None:
        self._items = []
