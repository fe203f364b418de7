"""What runs on each rank: module-level functions called through `collective_rpc` as ``fn(worker, ...)``.

The rank's LoRA state lives on the worker as ``worker.lora`` (a :class:`LoraState` over the pipeline's transformer),
created on first use. These functions see the worker as a :class:`~distvideo.lora.protocols.LoraWorker`
(``pipeline.transformer``, ``lora``), so this package imports nothing above it.
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Any

import torch

from distvideo.lora.formats import read_lora_file
from distvideo.lora.layers import LoraState
from distvideo.lora.protocols import LoraWorker


def lora_state(worker: LoraWorker) -> LoraState:
    """This rank's LoraState, created on first use for the pipeline's transformer."""
    pipeline = worker.pipeline
    if pipeline is None:
        raise RuntimeError("the worker has no model loaded (was it shut down?)")
    state = worker.lora
    if state is None or state.model is not pipeline.transformer:
        limit = worker.config.lora_cache_mb
        state = LoraState(pipeline.transformer, cache_bytes=(1024 if limit is None else limit) * 2**20)
        worker.lora = state
    return state


def prepare_adapter(
    worker: LoraWorker, nickname: str, path: str | None, strength: float, accumulate: bool
) -> dict[str, Any]:
    """Phase 1: load and check the adapter (or find the cached one); no weight changes. Returns its description
    (with the file's sha256, so the caller can check every rank loaded the same bytes)."""
    state = lora_state(worker)
    return state.prepare(nickname, partial(read_lora_file, path) if path is not None else None, strength, accumulate)


def abort_adapter(worker: LoraWorker) -> None:
    """Drop the prepared change (phase 1 failed somewhere)."""
    state = worker.lora
    if state is not None:
        state.abort()


def commit_adapter(worker: LoraWorker) -> dict[str, Any]:
    """Phase 2: apply the prepared change (merged into the weights)."""
    state = lora_state(worker)
    state.commit()
    return state.describe()


def merge_weights(worker: LoraWorker) -> dict[str, Any]:
    state = lora_state(worker)
    state.transition(state.active, merged=True)
    return state.describe()


def unmerge_weights(worker: LoraWorker) -> dict[str, Any]:
    state = lora_state(worker)
    state.transition(state.active, merged=False)
    return state.describe()


def clear_adapters(worker: LoraWorker) -> dict[str, Any]:
    state = lora_state(worker)
    state.transition([], merged=True)
    return state.describe()


def remove_adapter(worker: LoraWorker, nickname: str) -> dict[str, Any]:
    state = lora_state(worker)
    state.remove(nickname)
    return state.describe()


def rollback(worker: LoraWorker) -> None:
    """Undo the last LoRA transition on this rank (it failed on another one)."""
    state = worker.lora
    if state is not None:
        state.rollback()


def describe(worker: LoraWorker) -> dict[str, Any]:
    """This rank's LoRA state: active adapters with strengths, merged or not, cached nicknames."""
    return lora_state(worker).describe()


def transformer_digest(worker: LoraWorker) -> str:
    """sha256 of the transformer's parameters and buffers (names, dtypes, shapes, bytes): equal digests mean
    bit-identical weights, e.g. across ranks or before/after a LoRA round trip."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in worker.pipeline.transformer.state_dict().items():
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
