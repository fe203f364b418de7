"""`collective_rpc`, the one call every rank runs, as structural types: its signature, written once here (`RpcCall`)
and implemented once (executors/base.py, with the executors' call options on top). The generator hands out its
executor's; what calls it from above or below the executors (the service and the benchmark through
`protocols.GeneratorHandle`, the LoRA transactions through `lora.protocols.LoraExecutor`) asks for `CollectiveRpc`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class RpcCall(Protocol):
    def __call__(
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


class CollectiveRpc(Protocol):
    @property
    def collective_rpc(self) -> RpcCall: ...
