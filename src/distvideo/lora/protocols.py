"""What the LoRA package needs of the layers above it, as Protocols: it imports nothing from them."""

from __future__ import annotations

from typing import Any, Protocol

from distvideo.lora.layers import LoraState
from distvideo.rpc import CollectiveRpc


class LoraExecutor(CollectiveRpc, Protocol):
    """The executor as the caller's side of a LoRA transaction sees it (distvideo.executors.Executor)."""

    world_size: int

    @property
    def is_output_rank(self) -> bool: ...

    def ensure_consistent(self, what: str, fields: dict[str, Any]) -> None: ...


class LoraWorker(Protocol):
    """One rank as the rank's side of a LoRA change sees it (distvideo.worker.Worker): the loaded pipeline (its
    ``transformer``, and ``transformer_2`` when it has two experts) and the rank's LoRA state per transformer."""

    pipeline: Any
    lora: dict[str, LoraState]
    config: Any  # distvideo.config.EngineConfig: lora_cache_mb
