"""The inline executor: one rank, in this process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distvideo.engine import ResolvedEngine
from distvideo.executors.base import Executor, RequestIds, collective_error, run_guarded
from distvideo.outputs import ItemOutcome, WorkerOutput
from distvideo.request import GenerationRequest
from distvideo.worker import RankInfo, Worker


class InlineExecutor(Executor):
    def __init__(self, engine: ResolvedEngine):
        self.world_size = 1
        self._requests = RequestIds()
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

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        if self.worker is None:
            raise RuntimeError("the executor is shut down; create a new VideoGenerator")
        worker = self.worker
        status = run_guarded(0, lambda: worker.execute_method(method, *args, **(kwargs or {})))
        error = collective_error(method, [status])
        if error is not None:
            raise error from status.exception
        return [status.result]

    def execute_forward(
        self, request: GenerationRequest, on_progress: Callable[[int, int], None] | None = None
    ) -> WorkerOutput:
        with self._requests.running() as cancelled:
            results = self.collective_rpc(
                "execute_forward", args=(request,), kwargs={"on_progress": on_progress, "cancelled": cancelled}
            )
        output: WorkerOutput = results[0]
        return output

    def execute_batch(
        self, shares: list[list[tuple[int, GenerationRequest]]], on_item: Callable[[ItemOutcome], None]
    ) -> None:
        with self._requests.running() as cancelled:
            self.collective_rpc("execute_batch", args=(shares, on_item), kwargs={"cancelled": cancelled})

    def cancel(self) -> None:
        self._requests.cancel()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
