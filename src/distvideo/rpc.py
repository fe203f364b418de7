"""`collective_rpc`, the one call every rank runs, as a structural type: its signature, written once. The executors
implement it (executors/base.py, with their call options on top), the generator passes it on, and what calls it
from above or below the executors (the service and the benchmark through `protocols.GeneratorHandle`, the LoRA
transactions through `lora.protocols.LoraExecutor`) asks for this Protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class CollectiveRpc(Protocol):
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Run `method` (a worker method's name, or a callable `fn(worker, *args, **kwargs)`) on every rank; every
        rank's result in rank order, or with `unique_reply_rank=r` rank r's result alone (under a launcher: this
        process's own rank's). `timeout`: seconds before the ranks count as stuck; None waits as long as it takes."""
        ...
