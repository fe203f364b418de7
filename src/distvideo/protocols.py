"""What the layers above the generator need of it, as structural types: `EngineHandle` for a batch (batch/ runs
beside the generator and never imports it), `GeneratorHandle` for the service and the benchmark. `VideoGenerator`
satisfies both; mypy checks it where a generator is passed in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from distvideo.rpc import CollectiveRpc

if TYPE_CHECKING:  # types only: nothing here runs an import of the generator or the executors
    from distvideo.config import EngineConfig
    from distvideo.engine import ResolvedEngine
    from distvideo.executors import Executor
    from distvideo.outputs import GenerationResult
    from distvideo.request import GenerationRequest, ResolvedRequest


class EngineHandle(Protocol):
    """A batch's view of a generator: the resolved engine, and the executor that runs the replicas' shares."""

    @property
    def engine(self) -> ResolvedEngine: ...

    @property
    def executor(self) -> Executor: ...


class GeneratorHandle(EngineHandle, CollectiveRpc, Protocol):
    """The service's and the benchmark's view of a generator: requests, cancellation, calls on every rank, LoRA."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_output_rank(self) -> bool: ...

    def generate_request(
        self, request: GenerationRequest | ResolvedRequest, on_progress: Callable[[int, int], None] | None = None
    ) -> GenerationResult: ...

    def cancel(self) -> None: ...

    def check_health(self) -> None: ...

    def set_lora_adapter(
        self,
        nickname: str,
        path: str | Path | None = None,
        strength: float = 1.0,
        accumulate: bool = False,
        *,
        target: str = "transformer",
    ) -> None: ...

    def clear_lora_adapters(self) -> None: ...
