"""The external-launcher executor: torchrun, srun or mpirun started this process, which is one rank.

Every process runs the same script (SPMD) and calls the same methods in the same order; each call
runs locally, then the ranks all-gather a small status over the CPU (gloo) group, so a failure on
any rank raises the same error on every rank and the group stays usable. Statuses and argument digests travel as
JSON in byte tensors, never as pickles: a peer's message is data, not code (docs/reliability.md, trust model).

Faults (docs/reliability.md): a collective that fails (a peer died, or did not arrive within dist_timeout) leaves the
process group unusable, so no further collective is attempted on it. The executor asks the rendezvous store which
ranks still have a heartbeat (executors/heartbeat.py), raises one ProcessGroupBrokenError naming the lost or stuck
ranks, releases the group without waiting on anyone, and raises that error again on every later call: the job must
be restarted.

The call options (executors/base.py) are local here: events reach this process's `on_event` from its own rank, and
`cancelled` reads the stop token of this process (`cancel()` on any rank stops every rank at the same step, since the
ranks decide together between steps). With `unique_reply_rank=r` only statuses travel and every process returns its
own rank's result: results that are not JSON (a forward's frames) stay where they are, the frames on the output
rank. A lockstep call that failed on this rank alone settles (SETTLE_S) before the exchange. `timeout` is refused and
`self_limit` not enforced: dist_timeout and the launcher's kill-on-failure bound a stuck call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from distvideo import envs
from distvideo.config import EngineConfig
from distvideo.engine import ResolvedEngine
from distvideo.errors import CollectiveError, ConfigError, DivergentCallError, ProcessGroupBrokenError
from distvideo.executors.base import (
    SETTLE_S,
    SHUT_DOWN,
    Call,
    Executor,
    RankStatus,
    collective_error,
    local_hooks,
    method_name,
    must_settle,
    run_guarded,
)
from distvideo.executors.heartbeat import Heartbeat, Pulse, diagnose, first_line, ranks_text
from distvideo.launch import torch_env_for
from distvideo.logging_utils import set_log_rank
from distvideo.parallel.collectives import collective
from distvideo.worker import RankInfo, Worker

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ExternalExecutor(Executor):
    def __init__(self, engine: ResolvedEngine):
        env = engine.launch
        if env is None:
            raise ConfigError("the external executor needs the launcher's environment (resolve_engine gives it)")
        super().__init__()
        self.launch_env = env
        self.config = engine.config
        self.world_size = env.world_size
        self.rank = env.rank
        self._call = 0  # calls made so far; every rank makes the same calls, so the numbers agree across ranks
        self._broken: ProcessGroupBrokenError | None = None
        self._heartbeat: Heartbeat | None = None
        set_log_rank(env.rank)
        envs.set_external(torch_env_for(env))  # env:// and any library reading torchrun's names see them
        self.worker: Worker | None = Worker(engine, RankInfo.launched(env))
        try:
            try:
                self.worker.init_device()
            except Exception as exc:
                if is_collective_failure(exc):
                    self._broken = ProcessGroupBrokenError(self._rendezvous_failure(exc))
                    raise self._broken from exc
                raise
            logger.debug("joined the rendezvous at %s:%d (%s)", env.master_addr, env.master_port, env.launcher)
            if env.world_size > 1:
                self._heartbeat = Heartbeat.start(env)
            # every rank loads, then all learn whether every rank succeeded (a file missing on one node)
            worker = self.worker
            status = self._run_local("load_model", worker.load_model)
            self._exchange("load_model", "load_model", status)
        except BaseException:
            self.shutdown()
            raise

    @property
    def is_output_rank(self) -> bool:
        return self.rank == self.output_rank

    def _live_worker(self) -> Worker:
        if self._broken is not None:
            raise ProcessGroupBrokenError(str(self._broken))
        if self.worker is None:
            raise RuntimeError(SHUT_DOWN)
        return self.worker

    # -- calls -----------------------------------------------------------------------------------
    def _dispatch(self, call: Call) -> Any:
        if call.timeout is not None:
            raise NotImplementedError(
                "collective_rpc(timeout=...) is not available under an external launcher: every rank runs the "
                "call itself. Use dist_timeout (seconds, applied to every process group) and the launcher's "
                "kill-on-failure option (torchrun does it by default, srun -K / --kill-on-bad-exit, mpirun by "
                "default) to bound a stuck call."
            )
        worker, options, method = self._live_worker(), call.options, call.method
        what = options.label or f"collective_rpc({method_name(method)!r})"
        call_kwargs = local_hooks(call.kwargs, options)
        status = self._run_local(what, lambda: worker.execute_method(method, *call.args, **call_kwargs))
        if call.unique_reply_rank is not None:  # only statuses travel: every process keeps its own rank's result
            self._exchange(what, method, dataclasses.replace(status, result=None), settle=options.lockstep)
            return status.result
        statuses = self._exchange(what, method, status, settle=options.lockstep)
        return [s.result for s in statuses]

    def ensure_consistent(self, what: str, fields: dict[str, Any]) -> None:
        self._live_worker()
        digests = {k: hashlib.sha256(repr(v).encode()).hexdigest()[:16] for k, v in fields.items()}
        shown = {k: _short(v) for k, v in fields.items()}
        self._begin(f"the argument check of {what}")
        gathered = self._collective(
            f"the argument check of {what}", lambda group: all_gather_json([digests, shown], group, self.world_size)
        )
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

    # -- the steps of a call ---------------------------------------------------------------------
    def _begin(self, what: str) -> None:
        self._call += 1
        self._publish("running", what)

    def _publish(self, phase: str, what: str, detail: str = "") -> None:
        if self._heartbeat is not None:
            self._heartbeat.publish(Pulse(0, self._call, phase, what, detail))

    def _run_local(self, what: str, fn: Callable[[], Any]) -> RankStatus:
        """Run this rank's part of a call; a collective that failed inside it breaks the group (no status exchange)."""
        self._begin(what)
        status = run_guarded(self.rank, fn)
        if not status.ok and status.exception is not None and is_collective_failure(status.exception):
            raise self._break(what, status.exception) from status.exception
        return status

    def _exchange(
        self, what: str, method: str | Callable[..., Any], status: RankStatus, *, settle: bool = False
    ) -> list[RankStatus]:
        """All-gather every rank's status; one RankFailure on every rank if any failed.

        `settle` (a lockstep call): when this rank failed on its own (`must_settle`), the others may be inside the call
        waiting in a collective for this rank, and would not reach the exchange before dist_timeout. If some are still
        inside after SETTLE_S, this rank leaves the group (which fails their collectives at once) and raises instead."""
        if settle and must_settle(status) and self.world_size > 1:
            self._publish("failed", what, f"{status.error_type}: {first_line(status.error_message)}")
            inside = self._ranks_still_inside(min(SETTLE_S, self.config.dist_timeout or SETTLE_S))
            if inside:
                assert status.exception is not None
                raise self._break(what, status.exception, local=status, inside=inside) from status.exception
        statuses = self._collective(what, lambda group: _all_gather_statuses(status, group, self.world_size))
        error = collective_error(method, statuses)
        if error is not None:
            raise error from status.exception
        return statuses

    def _collective(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run one collective of the executor's own (status exchange, argument check, broadcast)."""
        worker = self._live_worker()
        self._publish("exchanging", what)
        try:
            with collective(what):  # the executor's own exchanges: any failure is the group's
                out = fn(worker.cpu_group)
        except CollectiveError as exc:
            raise self._break(what, exc) from exc
        self._publish("idle", what)
        return out

    # -- faults ----------------------------------------------------------------------------------
    def _ranks_still_inside(self, within: float) -> list[int]:
        """Ranks that, `within` seconds from now, are still running this call (or have not reached it) and are alive."""
        heartbeat = self._heartbeat
        if heartbeat is None:
            return []  # cannot tell: exchange as usual (the others may wait up to dist_timeout)
        deadline = time.monotonic() + within
        first: dict[int, Pulse] | None = None
        while True:
            try:
                pulses = heartbeat.read()
            except Exception:
                return []  # the store is gone with its host: the exchange fails at once and says so
            first = pulses if first is None else first
            inside = [
                r for r, p in pulses.items() if p.call < self._call or (p.call == self._call and p.phase == "running")
            ]
            if not inside:
                return []
            if time.monotonic() >= deadline:  # a rank whose heartbeat stopped is dead: the exchange fails at once
                return [r for r in inside if r not in first or pulses[r].beat != first[r].beat]
            time.sleep(0.1)

    def _break(
        self, what: str, exc: BaseException, *, local: RankStatus | None = None, inside: list[int] | None = None
    ) -> ProcessGroupBrokenError:
        """Mark the group broken, release it without waiting on any peer, and return the error to raise."""
        details: list[str] = []
        if inside:
            assert local is not None
            ranks = ranks_text(inside)
            headline = f"{what} failed on rank {self.rank} while {ranks} {'was' if len(inside) == 1 else 'were'} still inside it"
            details.append(f"  rank {self.rank} (this rank): {local.error_type}: {first_line(local.error_message)}")
            details.append(
                f"  {ranks}: still running {what} (call {self._call}) and would wait in a collective for rank "
                f"{self.rank} until dist_timeout, so rank {self.rank} left the process group to release "
                f"{'it' if len(inside) == 1 else 'them'}"
            )
        else:
            headline, details = diagnose(self._heartbeat, self.launch_env, self._call)
            details.append(
                f"  rank {self.rank} (this rank): the collective failed: {type(exc).__name__}: {first_line(exc)}"
            )
        message = "\n".join(
            [
                f"{headline} during {what} (seen from rank {self.rank}): the process group is broken; the job must be "
                "restarted.",
                *details,
                "No collective can succeed on this process group again; every later call raises this error. Restart "
                "the job (every rank).",
            ]
        )
        error = ProcessGroupBrokenError(message)
        self._broken = error
        logger.error("%s", message)
        # Tracebacks keep their frames' locals (modules, process groups) alive; free them so the group's connections
        # close now and peers still waiting on this rank fail at once.
        for failed in (exc, local.exception if local is not None else None):
            if failed is not None and failed.__traceback__ is not None:
                traceback.clear_frames(failed.__traceback__)
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.shutdown(broken=True)
        return error

    def _rendezvous_failure(self, exc: BaseException) -> str:
        env = self.launch_env
        return (
            f"rank {env.rank} could not form the process group of {env.world_size} ranks through the rendezvous at "
            f"{env.master_addr}:{env.master_port} ({env.launcher}) within {_timeout_text(self.config)}: "
            f"{type(exc).__name__}: {first_line(exc)}. Every rank must be started and reach that address; a rank "
            "that exited early (see its output) never joins."
        )

    def shutdown(self) -> None:
        heartbeat, self._heartbeat = getattr(self, "_heartbeat", None), None
        if heartbeat is not None:
            heartbeat.stop()
        worker, self.worker = getattr(self, "worker", None), None
        if worker is not None:
            worker.shutdown(broken=getattr(self, "_broken", None) is not None)


# --- helpers --------------------------------------------------------------------------------------------------------
def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` says the process group itself failed (a peer gone or late), not the call's own logic: decided by
    type. Our collectives raise CollectiveError (parallel/collectives.py); torch's rendezvous and store errors are
    DistErrors."""
    return isinstance(exc, (CollectiveError, dist.DistError)) and not isinstance(exc, ProcessGroupBrokenError)


def all_gather_json(value: Any, group: Any, world_size: int) -> list[Any]:
    """Every rank's `value`, in rank order, as JSON through byte tensors (two all-gathers: sizes, then padded
    bytes). A value that is not JSON raises TypeError before any communication."""
    data = json.dumps(value, allow_nan=True).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    return [json.loads(t[: int(n)].numpy().tobytes()) for t, n in zip(gathered, sizes, strict=True)]


_STATUS_FIELDS = ("rank", "ok", "result", "error_type", "error_message", "traceback")


def _all_gather_statuses(status: RankStatus, group: Any, world_size: int) -> list[RankStatus]:
    """Every rank's RankStatus. A result that is not JSON (collective_rpc results must be, under a launcher) turns
    into this rank's failure, reported on every rank."""
    fields = {name: getattr(status, name) for name in _STATUS_FIELDS}
    try:
        json.dumps(fields["result"], allow_nan=True)
    except (TypeError, ValueError) as exc:
        fields.update(
            ok=False,
            result=None,
            error_type="TypeError",
            error_message=(
                f"the result ({type(status.result).__name__}) cannot be sent to the other ranks: under an external "
                f"launcher collective_rpc results travel as JSON ({exc})"
            ),
        )
    return [RankStatus(**gathered) for gathered in all_gather_json(fields, group, world_size)]


def _timeout_text(config: EngineConfig) -> str:
    if config.dist_timeout:
        return f"dist_timeout={config.dist_timeout:g} s"
    return "torch's default timeout (dist_timeout is unset; pass --dist-timeout S)"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
