"""The external-launcher executor: torchrun, srun or mpirun started this process, which is one rank.

Every process runs the same script (SPMD) and calls the same methods in the same order; each call
runs locally, then the ranks all-gather a small status over the CPU (gloo) group, so a failure on
any rank raises the same error on every rank and the group stays usable.

Faults (docs/reliability.md): a collective that fails (a peer died, or did not arrive within dist_timeout) leaves the
process group unusable, so no further collective is attempted on it. The executor asks the rendezvous store which
ranks still have a heartbeat, raises one ProcessGroupBrokenError naming the lost or stuck ranks, releases the group
without waiting on anyone, and raises that error again on every later call: the job must be restarted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from distvideo import envs
from distvideo.config import ConfigError, EngineConfig, GenerationRequest
from distvideo.executors.base import Executor, RankStatus, collective_error, method_name, run_guarded
from distvideo.launch import LaunchEnv, read_launch_environ, resolve_launch_env, torch_env_for
from distvideo.logging_utils import set_log_rank
from distvideo.models.registry import ModelInfo
from distvideo.worker import RankInfo, Worker, WorkerOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEARTBEAT_INTERVAL_S = 0.5  # how often each rank bumps its heartbeat in the rendezvous store
LOST_AFTER_S = 3.0  # after a failed collective: a rank whose heartbeat does not move for this long is lost
SETTLE_S = 5.0  # after execute_forward failed on this rank only: how long the others get to finish the call


class DivergentCallError(ConfigError):
    """Ranks were given different arguments for the same call (a divergent SPMD script)."""


class ProcessGroupBrokenError(RuntimeError):
    """A collective failed (a rank died, did not arrive within dist_timeout, or left the group after a failure of its
    own): no collective can succeed on this process group again. The job must be restarted."""


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
        self.config = config
        self.world_size = env.world_size
        self.rank = env.rank
        self._call = 0  # calls made so far; every rank makes the same calls, so the numbers agree across ranks
        self._broken: ProcessGroupBrokenError | None = None
        self._heartbeat: _Heartbeat | None = None
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
            try:
                self.worker.init_device()
            except Exception as exc:
                if _is_collective_failure(exc):
                    self._broken = ProcessGroupBrokenError(self._rendezvous_failure(exc))
                    raise self._broken from exc
                raise
            logger.debug("joined the rendezvous at %s:%d (%s)", env.master_addr, env.master_port, env.launcher)
            if env.world_size > 1:
                self._heartbeat = _Heartbeat.start(env)
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
            raise RuntimeError("the executor is shut down; create a new VideoGenerator")
        return self.worker

    # -- calls -----------------------------------------------------------------------------------
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
        what = f"collective_rpc({method_name(method)!r})"
        status = self._run_local(what, lambda: worker.execute_method(method, *args, **(kwargs or {})))
        statuses = self._exchange(what, method, status)
        return [s.result for s in statuses]

    def execute_forward(self, request: GenerationRequest) -> WorkerOutput:
        """Like collective_rpc, but only statuses travel: frames stay on the output rank."""
        worker = self._live_worker()
        status = self._run_local("execute_forward", lambda: worker.execute_method("execute_forward", request))
        local = status.result
        self._exchange("execute_forward", "execute_forward", dataclasses.replace(status, result=None), settle=True)
        return local

    def ensure_consistent(self, what: str, fields: dict[str, Any]) -> None:
        self._live_worker()
        digests = {k: hashlib.sha256(repr(v).encode()).hexdigest()[:16] for k, v in fields.items()}
        shown = {k: _short(v) for k, v in fields.items()}
        self._begin(f"the argument check of {what}")
        gathered = self._collective(
            f"the argument check of {what}", lambda group: self._all_gather((digests, shown), group)
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

    def broadcast_from_output_rank(self, value: Any) -> Any:
        self._live_worker()
        self._begin("broadcast_from_output_rank")

        def broadcast(group: Any) -> Any:
            box = [value if self.is_output_rank else None]
            dist.broadcast_object_list(box, src=self.output_rank, group=group)
            return box[0]

        return self._collective("broadcast_from_output_rank", broadcast)

    # -- the steps of a call ---------------------------------------------------------------------
    def _begin(self, what: str) -> None:
        self._call += 1
        self._publish("running", what)

    def _publish(self, phase: str, what: str, detail: str = "") -> None:
        if self._heartbeat is not None:
            self._heartbeat.publish(_Pulse(0, self._call, phase, what, detail))

    def _run_local(self, what: str, fn: Callable[[], Any]) -> RankStatus:
        """Run this rank's part of a call; a collective that failed inside it breaks the group (no status exchange)."""
        self._begin(what)
        status = run_guarded(self.rank, fn)
        if not status.ok and status.exception is not None and _is_collective_failure(status.exception):
            raise self._break(what, status.exception) from status.exception
        return status

    def _exchange(
        self, what: str, method: str | Callable[..., Any], status: RankStatus, *, settle: bool = False
    ) -> list[RankStatus]:
        """All-gather every rank's status; one RankFailure on every rank if any failed.

        `settle` (execute_forward): when this rank failed on its own, the others may be inside the call waiting in a
        collective for this rank, and would not reach the exchange before dist_timeout. If some are still inside after
        SETTLE_S, this rank leaves the group (which fails their collectives at once) and raises instead."""
        if not status.ok and settle and self.world_size > 1:
            self._publish("failed", what, f"{status.error_type}: {_first_line(status.error_message)}")
            inside = self._ranks_still_inside(min(SETTLE_S, self.config.dist_timeout or SETTLE_S))
            if inside:
                assert status.exception is not None
                raise self._break(what, status.exception, local=status, inside=inside) from status.exception
        statuses = self._collective(what, lambda group: self._all_gather(status.for_transport(), group))
        error = collective_error(method, statuses)
        if error is not None:
            raise error from status.exception
        return statuses

    def _all_gather(self, obj: Any, group: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=group)
        return gathered

    def _collective(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run one collective of the executor's own (status exchange, argument check, broadcast)."""
        worker = self._live_worker()
        self._publish("exchanging", what)
        try:
            out = fn(worker.cpu_group)
        except Exception as exc:
            if _is_collective_failure(exc):
                raise self._break(what, exc) from exc
            raise
        self._publish("idle", what)
        return out

    # -- faults ----------------------------------------------------------------------------------
    def _ranks_still_inside(self, within: float) -> list[int]:
        """Ranks that, `within` seconds from now, are still running this call (or have not reached it) and are alive."""
        heartbeat = self._heartbeat
        if heartbeat is None:
            return []  # cannot tell: exchange as usual (the others may wait up to dist_timeout)
        deadline = time.monotonic() + within
        first: dict[int, _Pulse] | None = None
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
            ranks = _ranks_text(inside)
            headline = f"{what} failed on rank {self.rank} while {ranks} {'was' if len(inside) == 1 else 'were'} still inside it"
            details.append(f"  rank {self.rank} (this rank): {local.error_type}: {_first_line(local.error_message)}")
            details.append(
                f"  {ranks}: still running {what} (call {self._call}) and would wait in a collective for rank "
                f"{self.rank} until dist_timeout, so rank {self.rank} left the process group to release "
                f"{'it' if len(inside) == 1 else 'them'}"
            )
        else:
            headline, details = self._diagnose()
            details.append(
                f"  rank {self.rank} (this rank): the collective failed: {type(exc).__name__}: {_first_line(exc)}"
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

    def _diagnose(self) -> tuple[str, list[str]]:
        """(headline, one line per abnormal peer) from the peers' heartbeats."""
        others = [r for r in range(self.world_size) if r != self.rank]
        heartbeat = self._heartbeat
        if heartbeat is None:
            return "a peer failed or is stuck", ["  the ranks' heartbeats are unavailable, so which one cannot be told"]
        try:
            pulses, alive = heartbeat.survey(LOST_AFTER_S)
        except Exception as exc:
            env = self.launch_env
            where = f"{env.master_addr}:{env.master_port}"
            if envs.is_set("TORCHELASTIC_RUN_ID"):  # torchrun's agent hosts the store, not rank 0
                return "the torchrun agent is gone", [
                    f"  the rendezvous store the agent hosts at {where} is unreachable ({_first_line(exc)})"
                ]
            return "rank 0 lost", [
                f"  rank 0: lost: the rendezvous store it hosts at {where} is unreachable ({_first_line(exc)}): its "
                "process died (killed, out of memory or crashed; see its output and the launcher's report)"
            ]
        lost, failed, stuck, lines = [], [], [], []
        for r in others:
            pulse = pulses.get(r)
            last = f"; its last report: {pulse.describe()}" if pulse is not None else ""
            if r not in alive and pulse is not None and pulse.phase == "failed":
                failed.append(r)
                lines.append(f"  rank {r}: {pulse.describe()}; its heartbeat has stopped since (the process ended)")
            elif r not in alive:
                lost.append(r)
                lines.append(
                    f"  rank {r}: lost: no heartbeat for {LOST_AFTER_S:g} s (its process died: killed, out of memory "
                    f"or crashed; see its output and the launcher's report){last}"
                )
            elif pulse is not None and pulse.phase == "failed":
                failed.append(r)
                lines.append(f"  rank {r}: alive, but {pulse.describe()}")
            elif pulse is not None and (pulse.call < self._call or pulse.phase == "running"):
                stuck.append(r)
                lines.append(
                    f"  rank {r}: alive, but did not reach the collective within dist_timeout: {pulse.describe()}"
                )
        if lost:
            return f"{_ranks_text(lost)} lost", lines
        if failed:
            return f"{_ranks_text(failed)} failed", lines
        if stuck:
            return f"{_ranks_text(stuck)} not responding", lines
        return "a collective failed although every rank is alive", lines

    def _rendezvous_failure(self, exc: BaseException) -> str:
        env = self.launch_env
        return (
            f"rank {env.rank} could not form the process group of {env.world_size} ranks through the rendezvous at "
            f"{env.master_addr}:{env.master_port} ({env.launcher}) within {_timeout_text(self.config)}: "
            f"{type(exc).__name__}: {_first_line(exc)}. Every rank must be started and reach that address; a rank "
            "that exited early (see its output) never joins."
        )

    def shutdown(self) -> None:
        heartbeat, self._heartbeat = getattr(self, "_heartbeat", None), None
        if heartbeat is not None:
            heartbeat.stop()
        worker, self.worker = getattr(self, "worker", None), None
        if worker is not None:
            worker.shutdown(broken=getattr(self, "_broken", None) is not None)


# --- heartbeats -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Pulse:
    """One heartbeat: its counter, and what the rank was doing (call number, phase, call name, failure text)."""

    beat: int
    call: int
    phase: str  # "running" (its part of the call), "exchanging" (in a collective), "failed", "idle"
    what: str
    detail: str = ""

    def encode(self) -> str:
        return "|".join([str(self.beat), str(self.call), self.phase, self.what, self.detail.replace("\n", " ")])

    @classmethod
    def decode(cls, raw: bytes) -> _Pulse:
        beat, call, phase, what, detail = raw.decode(errors="replace").split("|", 4)
        return cls(int(beat), int(call), phase, what, detail)

    def describe(self) -> str:
        if self.phase == "failed":
            return f"failed in {self.what} (call {self.call}): {self.detail}"
        verb = {"running": "running", "exchanging": "in the collective of", "idle": "done with"}.get(self.phase, "in")
        return f"{verb} {self.what} (call {self.call})"


class _Heartbeat:
    """This rank's heartbeat in the rendezvous store (`distvideo/heartbeat/<n>/<rank>`): a daemon thread bumps a counter
    every HEARTBEAT_INTERVAL_S, with what the rank is doing, on its own connection. After a failed collective the
    survivors read the others': a counter that stopped is a lost rank, one that moves is a busy or stuck rank, and its
    text says where. The store lives in rank 0 (hand-started, srun, mpirun) or in the torchrun agent."""

    instances = 0  # heartbeats started in this process; every rank starts the same ones, so the numbers agree

    def __init__(self, env: LaunchEnv):
        self.rank, self.world_size = env.rank, env.world_size
        _Heartbeat.instances += 1
        self._prefix = f"distvideo/heartbeat/{_Heartbeat.instances}/"  # a later generator's keys are its own
        self._publisher = self._connect(env)  # the thread's connection
        self._reader = self._connect(env)  # the caller's
        self._pulse = _Pulse(0, 0, "idle", "start-up")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distvideo-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, env: LaunchEnv) -> _Heartbeat | None:
        try:
            return cls(env)
        except Exception:  # no heartbeats: faults are still raised, only without naming the rank
            logger.warning("cannot reach the rendezvous store for heartbeats; a lost rank will not be named")
            logger.debug("heartbeat start-up failed", exc_info=True)
            return None

    @staticmethod
    def _connect(env: LaunchEnv) -> dist.TCPStore:
        return dist.TCPStore(
            env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False
        )

    def key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def publish(self, pulse: _Pulse) -> None:
        """Called by the main thread at each phase of a call: no I/O, so calls cost nothing more; the thread sends the
        latest state with its next beat (the readers wait seconds, never less than a beat)."""
        self._pulse = pulse

    def _run(self) -> None:
        beat = 0
        while not self._stopped.is_set():
            beat += 1
            pulse = dataclasses.replace(self._pulse, beat=beat)
            try:
                self._publisher.set(self.key(self.rank), pulse.encode())
            except Exception:
                return  # the store went away with its host; the survivors find out when they look
            self._stopped.wait(HEARTBEAT_INTERVAL_S)

    def read(self) -> dict[int, _Pulse]:
        """The last pulse of every other rank that sent one; raises when the store is unreachable."""
        out: dict[int, _Pulse] = {}
        for r in range(self.world_size):
            if r != self.rank and self._reader.check([self.key(r)]):
                out[r] = _Pulse.decode(self._reader.get(self.key(r)))
        return out

    def survey(self, within: float) -> tuple[dict[int, _Pulse], set[int]]:
        """(last pulse of each other rank, the ranks whose heartbeat moved within `within` seconds)."""
        first = self.read()
        latest, alive = dict(first), set()
        deadline = time.monotonic() + within
        while True:
            now = self.read()
            alive |= {r for r, p in now.items() if r not in first or p.beat != first[r].beat}
            latest.update(now)
            if len(alive) >= self.world_size - 1 or time.monotonic() >= deadline:
                return latest, alive
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the thread and close both connections now. A connection left to the garbage collector keeps rank 0's
        store alive, and a later process group on the same port (a new VideoGenerator) would find its stale keys."""
        self._stopped.set()
        self._thread.join(timeout=2.0)
        self._publisher = self._reader = None  # type: ignore[assignment]


# --- helpers --------------------------------------------------------------------------------------------------------
_COLLECTIVE_FAILURE_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe", "peer")


def _is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` says the process group itself failed (a peer gone or late), not the call's own logic: a
    torch.distributed error, or a RuntimeError raised inside torch.distributed that speaks of the transport."""
    if isinstance(exc, (ProcessGroupBrokenError, ConfigError)):
        return False
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    in_torch_distributed = any(
        "torch/distributed/" in frame.filename.replace("\\", "/") for frame in traceback.extract_tb(exc.__traceback__)
    )
    text = str(exc).lower()
    return in_torch_distributed and any(word in text for word in _COLLECTIVE_FAILURE_WORDS)


def _first_line(exc: BaseException | str) -> str:
    """The message without the C++ stack torch appends ("Exception raised from ...")."""
    text = str(exc).split("\nException raised from", 1)[0].strip()
    return text.splitlines()[0] if text else ""


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _timeout_text(config: EngineConfig) -> str:
    if config.dist_timeout:
        return f"dist_timeout={config.dist_timeout:g} s"
    return "torch's default timeout (dist_timeout is unset; pass --dist-timeout S)"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
