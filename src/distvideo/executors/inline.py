"""The inline executor: one rank, in this process; `collective_rpc` is a guarded call of the worker.

Events are delivered as the worker emits them and `cancelled` reads the call's stop token directly (the rank is in
this process). `timeout` and `self_limit` are not enforced: nothing else could run the rank while the call is stuck.
"""

from __future__ import annotations

from typing import Any

from distvideo.engine import ResolvedEngine
from distvideo.executors.base import (
    SHUT_DOWN,
    Call,
    Executor,
    collective_error,
    local_hooks,
    run_guarded,
)
from distvideo.worker import RankInfo, Worker


class InlineExecutor(Executor):
    def __init__(self, engine: ResolvedEngine):
        super().__init__()
        self.world_size = 1
        self.worker: Worker | None = Worker(engine, RankInfo.single())
        try:
            self.worker.init_device()
            self.worker.load_model()
        except BaseException:
            self.worker.shutdown()
            self.worker = None
            raise

    @property
    def is_output_rank(self) -> bool:
        return True

    def _dispatch(self, call: Call) -> Any:
        if self.worker is None:
            raise RuntimeError(SHUT_DOWN)
        worker, call_kwargs = self.worker, local_hooks(call.kwargs, call.options)
        status = run_guarded(0, lambda: worker.execute_method(call.method, *call.args, **call_kwargs))
        error = collective_error(call.method, [status])
        if error is not None:
            raise error from status.exception
        return [status.result] if call.unique_reply_rank is None else status.result

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
