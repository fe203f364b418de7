"""The Ray executor's remote side: one actor class per rank (`RankActor`) and the call's control actor (`CallControl`,
events from the ranks to the driver and the driver's cancellation to the ranks). Plain classes here; the executor
wraps them with `ray.remote` and its actor options, so this module imports Ray only inside its methods."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distvideo.engine import ResolvedEngine
from distvideo.executors.base import RankStatus, call_hooks, run_guarded

if TYPE_CHECKING:
    from distvideo.worker import Worker

logger = logging.getLogger(__name__)


class CallControl:
    """A small actor the driver and the ranks share: `emit` appends a call's event, the driver `drain`s them while it
    waits; `cancel(call_id)` marks a call stopped, the ranks read it between denoising steps."""

    def __init__(self) -> None:
        self._events: list[tuple[int, Any]] = []
        self._cancelled = -1

    def emit(self, call_id: int, value: Any) -> None:
        self._events.append((call_id, value))

    def drain(self) -> list[tuple[int, Any]]:
        events, self._events = self._events, []
        return events

    def cancel(self, call_id: int) -> None:
        self._cancelled = call_id

    def cancelled(self, call_id: int) -> bool:
        return self._cancelled == call_id


class RankActor:
    """One rank. `place()` says where Ray put it; `start()` joins the env:// rendezvous and loads the model; `call()`
    runs one collective_rpc's part on this rank and answers with its RankStatus."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.rank = -1

    def place(self) -> tuple[str, str]:
        """(node id, CUDA_VISIBLE_DEVICES Ray gave this actor)."""
        import ray

        from distvideo import envs

        return ray.get_runtime_context().get_node_id(), envs.get_raw("CUDA_VISIBLE_DEVICES") or ""

    def free_port(self, address: str) -> int:
        """A port free on this node's `address` now, for the rendezvous rank 0 hosts."""
        with socket.socket() as sock:
            sock.bind((address, 0))
            return int(sock.getsockname()[1])

    def alive(self) -> None:
        """The monitor's probe between calls: answering is the whole point."""

    def start(
        self,
        engine: ResolvedEngine,
        rank: int,
        local: tuple[int, int],
        init_method: str,
        master: tuple[str, int] | None,
        loopback: bool,
    ) -> RankStatus:
        """Join the rendezvous (`init_method`: a file store, or env:// at `master`) and load the model; `local`: this
        rank's (local rank, local world size) on its node; `loopback`: every rank is on this machine, so gloo listens
        on the loopback interface only."""
        from distvideo import envs
        from distvideo.logging_utils import configure_logging, set_log_rank
        from distvideo.machine import bind_gloo_to_loopback
        from distvideo.worker import RankInfo, Worker

        self.rank = rank
        set_log_rank(rank)
        configure_logging(engine.config.log_level)
        local_rank, local_world = local
        world = engine.world_size
        if master is not None:
            env: dict[str, str | int] = {"MASTER_ADDR": master[0], "MASTER_PORT": master[1], "RANK": rank}
            envs.set_external({**env, "WORLD_SIZE": world, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world})
        if loopback:
            bind_gloo_to_loopback()
        info = RankInfo(rank, local_rank, world, local_world, init_method)

        def start_worker() -> str:
            self.worker = Worker(engine, info)
            self.worker.init_device()
            self.worker.load_model()
            return "ready"

        return run_guarded(rank, start_worker).for_transport()

    def call(
        self,
        call_id: int,
        method: str | Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        control: Any,  # the CallControl actor's handle, when the call has events or a stop token
        events: bool,
        stoppable: bool,
        replies: bool,
    ) -> RankStatus:
        import ray

        worker = self.worker
        assert worker is not None, "call() before a successful start()"

        def emit(value: Any) -> None:  # waits for the control actor: every event is there before the answer
            ray.get(control.emit.remote(call_id, value))

        def cancelled() -> bool:
            return bool(ray.get(control.cancelled.remote(call_id)))

        hooks = call_hooks(kwargs, emit if events and replies else None, cancelled if stoppable else None)
        status = run_guarded(self.rank, lambda: worker.execute_method(method, *args, **hooks))
        if not replies:
            status.result = None
        return status.for_transport()

    def stop(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.shutdown()
