"""The external-launcher executor: torchrun, srun or mpirun started this process, which is one rank.

Every process runs the same script (SPMD) and calls the same methods in the same order; each call
runs locally, then the ranks all-gather a small status over the CPU (gloo) group, so a failure on
any rank raises the same error on every rank and the group stays usable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from distvideo import envs
from distvideo.config import ConfigError, EngineConfig, GenerationRequest
from distvideo.executors.base import Executor, RankStatus, collective_error, run_guarded
from distvideo.launch import LaunchEnv, read_launch_environ, resolve_launch_env, torch_env_for
from distvideo.logging_utils import set_log_rank
from distvideo.models.registry import ModelInfo
from distvideo.worker import RankInfo, Worker, WorkerOutput

logger = logging.getLogger(__name__)


class DivergentCallError(ConfigError):
    """Ranks were given different arguments for the same call (a divergent SPMD script)."""


def resolve_external_env(config: EngineConfig) -> LaunchEnv:
    try:
        env = resolve_launch_env(read_launch_environ())
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"executor='external': {exc}") from None
    if config.num_gpus is not None and config.num_gpus != env.world_size:
        raise ConfigError(
            f"num_gpus={config.num_gpus} but the launcher ({env.launcher}) started {env.world_size} processes; "
            f"pass num_gpus={env.world_size} (the total number of launched processes) or leave it unset"
        )
    return env


class ExternalExecutor(Executor):
    def __init__(self, config: EngineConfig, model_info: ModelInfo):
        env = resolve_external_env(config)
        self.launch_env = env
        self.world_size = env.world_size
        self.rank = env.rank
        set_log_rank(env.rank)
        envs.set_external(torch_env_for(env))  # env:// and any library reading torchrun's names see them
        rank_info = RankInfo(
            rank=env.rank,
            local_rank=env.local_rank,
            world_size=env.world_size,
            local_world_size=env.local_world_size,
            init_method="env://",
            output_rank=0,
        )
        self.worker: Worker | None = Worker(config, rank_info, model_info=model_info)
        try:
            self.worker.init_device()
            logger.debug("joined the rendezvous at %s:%d (%s)", env.master_addr, env.master_port, env.launcher)
            # every rank loads, then all learn whether every rank succeeded (a file missing on one node)
            worker = self.worker
            status = run_guarded(env.rank, worker.load_model)
            self._raise_if_failed("load_model", self._gather_statuses(status), status)
        except BaseException:
            self.shutdown()
            raise

    @property
    def is_output_rank(self) -> bool:
        return self.rank == self.output_rank

    def _live_worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the executor is shut down; create a new VideoGenerator")
        return self.worker

    def _gather_statuses(self, status: RankStatus) -> list[RankStatus]:
        worker = self._live_worker()
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, status.for_transport(), group=worker.cpu_group)
        return gathered

    def _raise_if_failed(self, method: str | Callable[..., Any], statuses: list[RankStatus], local: RankStatus) -> None:
        error = collective_error(method, statuses)
        if error is not None:
            raise error from local.exception

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        if timeout is not None:
            raise NotImplementedError(
                "collective_rpc(timeout=...) is not available under an external launcher: every rank runs the "
                "call itself. Use dist_timeout (seconds, applied to every process group) and the launcher's "
                "kill-on-failure option (torchrun does it by default, srun -K / --kill-on-bad-exit, mpirun by "
                "default) to bound a stuck call."
            )
        worker = self._live_worker()
        status = run_guarded(self.rank, lambda: worker.execute_method(method, *args, **(kwargs or {})))
        statuses = self._gather_statuses(status)
        self._raise_if_failed(method, statuses, status)
        return [s.result for s in statuses]

    def execute_forward(self, request: GenerationRequest) -> WorkerOutput:
        """Like collective_rpc, but only statuses travel: frames stay on the output rank."""
        worker = self._live_worker()
        status = run_guarded(self.rank, lambda: worker.execute_method("execute_forward", request))
        local = status.result
        statuses = self._gather_statuses(dataclasses.replace(status, result=None))
        self._raise_if_failed("execute_forward", statuses, status)
        return local

    def ensure_consistent(self, what: str, fields: dict[str, Any]) -> None:
        worker = self._live_worker()
        digests = {k: hashlib.sha256(repr(v).encode()).hexdigest()[:16] for k, v in fields.items()}
        shown = {k: _short(v) for k, v in fields.items()}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (digests, shown), group=worker.cpu_group)
        reference = gathered[0][0]
        differing = sorted({k for d, _ in gathered for k in set(d) | set(reference) if d.get(k) != reference.get(k)})
        if not differing:
            return
        lines = [f"ranks disagree on the arguments of {what}; every rank must make the same calls in the same order:"]
        for name in differing:
            values = ", ".join(f"rank {r}: {g[1].get(name, '<missing>')}" for r, g in enumerate(gathered))
            lines.append(f"  {name}: {values}")
        lines.append("Give every rank the same arguments (e.g. the same --prompt and --seed on every rank).")
        raise DivergentCallError("\n".join(lines))

    def broadcast_from_output_rank(self, value: Any) -> Any:
        worker = self._live_worker()
        box = [value if self.is_output_rank else None]
        dist.broadcast_object_list(box, src=self.output_rank, group=worker.cpu_group)
        return box[0]

    def shutdown(self) -> None:
        worker, self.worker = getattr(self, "worker", None), None
        if worker is not None:
            worker.shutdown()


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
