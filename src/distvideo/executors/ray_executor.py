"""The Ray executor: one actor per rank on a Ray cluster, placed by a placement group of one bundle per rank.

Start-up: connect to the cluster (`ray_address`, else a running one, else a local one on 127.0.0.1 without a
dashboard), check `ray.cluster_resources()` against the bundles, reserve a PACK placement group (bounded wait), start
one actor per bundle, order the ranks by node with the driver's node first, and let them meet (ray_placement.py): in a
private file store when every rank runs on the driver's node, else through env:// at rank 0's node on a port free
there; gloo binds loopback when every rank is on one machine. Ray gives each actor its `CUDA_VISIBLE_DEVICES`.

A call is one actor method call per rank; the driver waits on their object refs with `ray.wait` in short slices, so a
dead actor (ActorDiedError) is reported at once; between calls a monitor thread probes the actors every second, so a
death while idle is logged at once, the other actors are killed and the next call (or `check_health`) raises the
WorkerDiedError. Events and cancellation travel through one small `CallControl` actor
(ray_rank.py). The executor contract (executors/base.py) is as on mp: per-call timeouts, lockstep settling, one
RankFailure; a timeout, a dead rank, a stuck lockstep call or Ctrl-C kill every actor and the placement group.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from typing import Any, NoReturn

from distvideo.engine import ResolvedEngine
from distvideo.errors import RankFailure, WorkerDiedError
from distvideo.executors.base import (
    PLAIN,
    Call,
    CallOptions,
    RankStatus,
)
from distvideo.executors.mp_wire import remote_traceback
from distvideo.executors.ray_placement import bundles_for, check_resources, connect, rank_order, rendezvous_kind
from distvideo.executors.ray_rank import CallControl, RankActor
from distvideo.executors.store import StoreAddress
from distvideo.executors.tracker import CallTracker, RemoteRanksExecutor, call_timeout

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # the cluster has the resources but others hold them: give up after this
WAIT_SLICE_S = 0.2  # one ray.wait: events are drained and Ctrl-C is seen at least this often
STARTUP_TIMEOUT_S = 900.0  # loading the model on every rank
MONITOR_S = 1.0  # while idle, the actors are asked this often whether they are alive
PROBE_TIMEOUT_S = 5.0  # an idle actor that does not answer a probe within this is slow, not dead: asked again later


class RayExecutor(RemoteRanksExecutor):
    """`num_gpus` Ray actors, one rank each; this process (the driver) holds the output."""

    kind = "ray"

    def __init__(self, engine: ResolvedEngine):
        super().__init__()
        import ray

        self.engine = engine
        self.world_size = engine.world_size
        self._actors: list[Any] = []  # in rank order
        self._placement: Any = None
        self._control: Any = None
        self._next_id = 0
        self._rendezvous_dir: str | None = None  # the file store's private directory, when the ranks use one
        self._master: tuple[str, int] | None = None  # rank 0's TCPStore, when the ranks meet through env://
        self._lock = threading.Lock()  # held by a call, and by the monitor while it probes the actors
        self._stopping = threading.Event()
        self._monitor_thread: threading.Thread | None = None
        self._connected = connect(engine.config.ray_address)
        try:
            resources: dict[str, Any] = ray.cluster_resources()  # type: ignore[no-untyped-call]
            cluster = {k: float(v) for k, v in resources.items()}
            bundles = bundles_for(engine, cluster)
            check_resources(bundles, cluster)
            self._start(bundles)
        except BaseException:
            self._dead = "start-up failed"
            self._release()
            raise
        self._monitor_thread = threading.Thread(target=self._monitor, name="distvideo-ray-monitor", daemon=True)
        self._monitor_thread.start()

    def _start(self, bundles: list[dict[str, float]]) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._placement = placement_group(bundles, strategy="PACK", name="distvideo")
        try:
            ray.get(self._placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources()  # type: ignore[no-untyped-call]
            raise RuntimeError(
                f"the Ray cluster could not reserve {len(bundles)} bundle(s) {bundles[0]} within "
                f"{PLACEMENT_TIMEOUT_S:g} s: other jobs hold them (free now: {free})"
            ) from None
        self._control = ray.remote(CallControl).options(num_cpus=0).remote()
        kind = next(iter(bundles[0]))
        actors: list[Any] = []
        for index in range(len(bundles)):
            strategy = PlacementGroupSchedulingStrategy(self._placement, placement_group_bundle_index=index)
            options: dict[str, Any] = {"num_cpus": 1 if kind == "CPU" else 0, "num_gpus": 1 if kind == "GPU" else 0}
            actors.append(ray.remote(RankActor).options(scheduling_strategy=strategy, **options).remote())
        self._actors = actors  # bundle order until ranked: killed on failure either way
        places: list[tuple[str, str]] = ray.get([a.place.remote() for a in actors], timeout=STARTUP_TIMEOUT_S)
        order = rank_order(ray.get_runtime_context().get_node_id(), [p[0] for p in places])
        self._actors = [actors[i] for i in order]
        nodes = [places[i][0] for i in order]
        registered: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in registered}  # as each node registered
        kind, host = rendezvous_kind(ray.get_runtime_context().get_node_id(), nodes, addresses)
        master: tuple[str, int] | None = None
        if kind == "file":  # no port: a directory only this user can open (mkdtemp makes it 0700), as mp's
            self._rendezvous_dir = tempfile.mkdtemp(prefix="distvideo-rendezvous-")
            init_method = f"file://{self._rendezvous_dir}/store"
        else:
            assert host is not None
            master = (host, int(ray.get(self._actors[0].free_port.remote(host), timeout=60)))
            init_method = "env://"
        self._master = master
        loopback = host is None or host.startswith("127.")
        logger.debug("ray ranks on nodes %s (CUDA_VISIBLE_DEVICES %s), rendezvous %s %s", nodes, places, kind, master)
        starts = [
            actor.start.remote(
                self.engine,
                rank,
                (nodes[:rank].count(nodes[rank]), nodes.count(nodes[rank])),
                init_method,
                master,
                loopback,
            )
            for rank, actor in enumerate(self._actors)
        ]
        tracker = CallTracker("start", self.world_size, STARTUP_TIMEOUT_S, PLAIN, unit="actor", label="start-up")
        self._gather(starts, tracker, 0)
        failed = [tracker.statuses[r] for r in range(self.world_size) if not tracker.statuses[r].ok]
        if failed:
            lines = [f"the ray executor could not start: {len(failed)} of {self.world_size} rank(s) failed:"]
            lines += [f"  rank {s.rank}: {s.error_type}: {s.error_message}" for s in failed]
            lines.append(f"model: {self.engine.config.model}")
            error = RankFailure("\n".join(lines), {s.rank: (s.error_type, s.error_message) for s in failed})
            raise error from remote_traceback(failed)

    @property
    def is_output_rank(self) -> bool:
        return True

    def rendezvous_store(self) -> StoreAddress | None:
        """Rank 0's TCPStore when the ranks span nodes (env://); None when they meet in a file store beside the
        driver."""
        if self._master is None:
            return None
        return StoreAddress(*self._master)

    # -- calls -----------------------------------------------------------------------------------
    def _dispatch(self, call: Call) -> Any:
        with self._lock:
            self._check_usable()
            return self._call(call)

    def _call(self, call: Call) -> Any:
        method, options = call.method, call.options
        tracker = CallTracker(method, self.world_size, call_timeout(call.timeout, options), options, unit="actor")
        self._next_id += 1
        call_id = self._next_id
        control = self._control if (options.on_event is not None or options.stop is not None) else None
        if options.stop is not None:
            options.stop.on_set(lambda: self._cancel(call_id))
        refs = [
            actor.call.remote(
                call_id,
                method,
                call.args,
                call.kwargs,
                control,
                options.on_event is not None,
                options.stop is not None,
                call.unique_reply_rank in (None, rank),
            )
            for rank, actor in enumerate(self._actors)
        ]
        try:
            self._gather(refs, tracker, call_id)
        except KeyboardInterrupt:
            self._dead = f"interrupted (KeyboardInterrupt) during {tracker.what}"
            self._release()
            raise
        return tracker.result(call.unique_reply_rank)

    def _cancel(self, call_id: int) -> None:
        if self._control is not None and self._dead is None:
            self._control.cancel.remote(call_id)

    def _check_usable(self) -> None:
        died_idle, self._died_idle = self._died_idle, None
        if died_idle is not None and not self._closed:  # the monitor saw it: the first call after it raises it
            raise died_idle
        self.check_health()

    def _monitor(self) -> None:
        """The monitor thread: while no call runs, probe every actor each MONITOR_S; a call in flight watches its
        actors itself (`_gather`), so the monitor skips a turn while one holds the lock."""
        while not self._stopping.wait(MONITOR_S):
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self._closed or self._dead is not None:
                    return
                try:
                    dead = self._probe()
                except Exception as exc:  # Ray going away under a shutdown, or a probe it could not run: no death
                    logger.debug("ray monitor: probe failed: %s", exc)
                    continue
                if dead is not None and not self._stopping.is_set():  # not a kill of shutdown's
                    self._idle_death(*dead)
                    return
            finally:
                self._lock.release()

    def _probe(self) -> tuple[int, BaseException] | None:
        """(rank, Ray's error) of the first actor found dead, or None."""
        import ray

        refs = [actor.alive.remote() for actor in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    return rank, exc
        return None

    def _idle_death(self, rank: int, exc: BaseException) -> None:
        self._dead = f"rank {rank} died ({type(exc).__name__}) while idle"
        error = WorkerDiedError(
            f"{self._dead}; the other ranks' actors were killed and this VideoGenerator can no longer be used: "
            "create a new one."
        )
        self._died_idle = error
        logger.error("%s", error)
        self._release(disconnect=False)  # ray.shutdown belongs to the thread that calls shutdown()

    def _gather(self, refs: list[Any], tracker: CallTracker, call_id: int) -> None:
        """Every rank's status into `tracker`; events drained to the call's `on_event` as the ranks emit them. An
        overdue call (the tracker's) kills every actor and raises."""
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        options = tracker.options
        while pending:
            overdue = tracker.overdue()
            if overdue is not None:
                self._dead = overdue.dead
                self._release()
                raise overdue.error from overdue.cause
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=tracker.wait_s(WAIT_SLICE_S))
            for ref in ready:
                rank = rank_of[ref]
                try:
                    status = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._died(rank, tracker.what, exc)
                except ray.exceptions.RayError as exc:  # Ray could not run the call there (e.g. unpickling it)
                    status = RankStatus.from_exception(rank, getattr(exc, "cause", None) or exc)
                tracker.answer(rank, status)
            self._drain(options, call_id)
        self._drain(options, call_id)

    def _drain(self, options: CallOptions, call_id: int) -> None:
        if options.on_event is None or self._control is None:
            return
        import ray

        for event_call, value in ray.get(self._control.drain.remote()):
            if event_call == call_id:
                options.on_event(value)

    def _died(self, rank: int, what: str, exc: BaseException) -> NoReturn:
        cause = type(exc).__name__
        self._dead = f"rank {rank} died ({cause}) during {what}"
        self._release()
        raise WorkerDiedError(
            f"{self._dead}; the other ranks' actors were killed and this VideoGenerator can no longer be used: "
            f"create a new one. Ray said: {str(exc).splitlines()[0] if str(exc) else cause}"
        ) from exc

    # -- shutdown --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._stopping.set()
        if self._dead is None and self._actors:
            import ray

            try:  # leave the process group cleanly; killed below either way
                ray.get([a.stop.remote() for a in self._actors], timeout=10)
            except Exception as exc:
                logger.debug("ray ranks did not stop cleanly: %s", exc)
        self._closed = True
        self._release()
        monitor = self._monitor_thread
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(PROBE_TIMEOUT_S + MONITOR_S)

    def _release(self, disconnect: bool = True) -> None:
        """Kill every actor, remove the placement group and the rendezvous directory, disconnect if this executor
        connected (and `disconnect`). Safe twice."""
        import ray

        self._dead = self._dead or "shut down"
        actors, self._actors = self._actors, []
        for actor in [*actors, self._control]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self._control = None
        placement, self._placement = self._placement, None
        if placement is not None:
            ray.util.remove_placement_group(placement)
        directory, self._rendezvous_dir = self._rendezvous_dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        if self._connected and disconnect:
            self._connected = False
            ray.shutdown()
