"""What runs on each rank: module-level functions called through `collective_rpc` as ``fn(worker, ...)``.

The rank's LoRA state lives on the worker as ``worker.lora``: one :class:`LoraState` per denoising transformer of the
pipeline (``transformer``, and ``transformer_2`` for Wan2.2 A14B's low-noise expert), created on first use. An adapter
changes one transformer (its `target`); merging, unmerging and clearing change all of them. These functions see the
worker as a :class:`~distvideo.lora.protocols.LoraWorker` (``pipeline.transformer``, ``lora``), so this package
imports nothing above it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from distvideo.lora.formats import LoraError, read_lora_file
from distvideo.lora.layers import LoraState
from distvideo.lora.protocols import LoraWorker

TARGETS = ("transformer", "transformer_2")


def lora_states(worker: LoraWorker) -> dict[str, LoraState]:
    """This rank's LoraState of every transformer the pipeline has, created on first use."""
    pipeline = worker.pipeline
    if pipeline is None:
        raise RuntimeError("the worker has no model loaded (was it shut down?)")
    states = worker.lora
    for name in TARGETS:
        module = getattr(pipeline, name, None)
        if module is None:
            states.pop(name, None)
        elif name not in states or states[name].model is not module:
            limit = worker.config.lora_cache_mb
            states[name] = LoraState(module, cache_bytes=(1024 if limit is None else limit) * 2**20)
    return states


def lora_state(worker: LoraWorker, target: str = "transformer") -> LoraState:
    """The LoraState of one transformer; a LoraError when the model has no such transformer."""
    states = lora_states(worker)
    if target not in states:
        raise LoraError(
            f"LoRA target {target!r}: this model has no {target} (its transformers: {', '.join(states)}); "
            "transformer_2 is the second (low-noise) expert of a two-expert model"
        )
    return states[target]


def prepare_adapter(
    worker: LoraWorker, nickname: str, path: str | None, strength: float, accumulate: bool, target: str = "transformer"
) -> dict[str, Any]:
    """Phase 1: load and check the adapter against `target` (or find the cached one); no weight changes. Returns its
    description (with the file's sha256, so the caller can check every rank loaded the same bytes)."""
    state = lora_state(worker, target)
    for other in lora_states(worker).values():
        other.abort()
    return state.prepare(nickname, partial(read_lora_file, path) if path is not None else None, strength, accumulate)


def abort_adapter(worker: LoraWorker) -> None:
    """Drop the prepared change (phase 1 failed somewhere)."""
    for state in worker.lora.values():
        state.abort()


def commit_adapter(worker: LoraWorker) -> dict[str, Any]:
    """Phase 2: apply the prepared change (merged into the weights of its transformer)."""
    states = lora_states(worker)
    pending = [state for state in states.values() if state.pending is not None]
    if not pending:
        raise RuntimeError("no prepared LoRA change to commit (prepare failed or was aborted)")
    for state in states.values():
        state.forget_undo()
    pending[0].commit()
    return describe(worker)


def _transition_all(worker: LoraWorker, change: Callable[[LoraState], None]) -> dict[str, Any]:
    """Apply `change` to every transformer's state; if one fails, this rank's others are rolled back first."""
    states = list(lora_states(worker).values())
    for state in states:
        state.forget_undo()
    done: list[LoraState] = []
    try:
        for state in states:
            change(state)
            done.append(state)
    except BaseException:
        for state in reversed(done):
            state.rollback()
        raise
    return describe(worker)


def merge_weights(worker: LoraWorker) -> dict[str, Any]:
    return _transition_all(worker, lambda state: state.transition(state.active, merged=True))


def unmerge_weights(worker: LoraWorker) -> dict[str, Any]:
    return _transition_all(worker, lambda state: state.transition(state.active, merged=False))


def clear_adapters(worker: LoraWorker) -> dict[str, Any]:
    return _transition_all(worker, lambda state: state.transition([], merged=True))


def remove_adapter(worker: LoraWorker, nickname: str) -> dict[str, Any]:
    """Drop a cached, inactive adapter from the transformer(s) that hold it."""
    holding = [state for state in lora_states(worker).values() if nickname in state.cache]
    for state in holding or [lora_state(worker)]:  # none holds it: the first one's error names what is cached
        state.remove(nickname)
    return describe(worker)


def rollback(worker: LoraWorker) -> None:
    """Undo the last LoRA transition on this rank (it failed on another one)."""
    for state in worker.lora.values():
        state.rollback()


def describe(worker: LoraWorker) -> dict[str, Any]:
    """This rank's LoRA state: active adapters with strengths, merged or not, cached nicknames (of `transformer`;
    a two-expert model adds the same under "transformer_2")."""
    states = lora_states(worker)
    described = states["transformer"].describe()
    if "transformer_2" in states:
        described["transformer_2"] = states["transformer_2"].describe()
    return described


def transformer_digest(worker: LoraWorker) -> str:
    """sha256 of the transformers' parameters and buffers (names, dtypes, shapes, bytes; both experts of a two-expert
    model): equal digests mean bit-identical weights, e.g. across ranks or before/after a LoRA round trip. Under
    sharded weights each parameter is gathered whole first (a collective over the replica's ranks: call it on every
    rank, as collective_rpc does), so the digest is the unsharded model's."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for prefix in TARGETS:
            module = getattr(worker.pipeline, prefix, None)
            if module is None:
                continue
            for name, tensor in module.state_dict().items():
                if hasattr(tensor, "full_tensor"):  # a DTensor: FSDP2's shard of this parameter
                    tensor = tensor.full_tensor()
                label = name if prefix == "transformer" else f"{prefix}.{name}"
                digest.update(f"{label}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
