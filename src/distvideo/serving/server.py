"""`distvideo serve`: one engine, loaded once, behind the HTTP API, on any executor.

Rank 0 (or the only process) binds the port, opens the job store and starts the HTTP server before the model loads
(/health says "loading" meanwhile), then runs the engine loop in the main thread. Under a launcher every other rank
loads the model and follows rank 0's jobs (channel.py); no other rank opens a port. With `--replicas N` (N > 1) every
rank runs its replica's loop instead (replica_loop.py) and rank 0 hands jobs to idle replicas (pool.py). A stop signal on any rank stops
admission, gives the running job the grace period, reaches every rank and exits 0; an engine failure exits 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import logging
import os
import secrets
import socket
import sqlite3
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distvideo.config import EngineConfig
from distvideo.engine import ResolvedEngine
from distvideo.errors import ConfigError, ProcessGroupBrokenError
from distvideo.executors import resolve_engine
from distvideo.executors.store import PrivateStore, StoreAddress
from distvideo.paths import check_output_target, resolve_lora_path
from distvideo.serving.adapters import Adapters
from distvideo.serving.admission import Admission
from distvideo.serving.board import ReplicaBoard
from distvideo.serving.channel import JobChannel
from distvideo.serving.events import JobEvents
from distvideo.serving.jobs import UNHEALTHY, Service
from distvideo.serving.lifecycle import HttpServer, StopSignals, bind
from distvideo.serving.options import ServeOptions, describe
from distvideo.serving.pool import ReplicaPool
from distvideo.serving.replica_loop import ReplicaSpec, run_replica
from distvideo.serving.runner import EngineLoop, follow
from distvideo.serving.store import STORE_NAME, JobStore

if TYPE_CHECKING:
    from distvideo.generator import VideoGenerator
    from distvideo.protocols import GeneratorHandle

logger = logging.getLogger("distvideo.serving")

HARD_EXIT_MARGIN_S = 30.0  # after the grace period: a shutdown still not done ends the process anyway


class Frontend:
    """What only rank 0 has: the store, the service state, the HTTP server."""

    def __init__(self, engine: ResolvedEngine, options: ServeOptions, presets: dict[str, Any]):
        # the port first: a host or port it cannot listen on fails before the output folder is made
        self.sock = _listen(options.host, options.port)  # before any weight loads, too
        try:
            output = Path(options.output).resolve()
            self._lock = _open_output(output)  # one server per store: a second one would fail the first one's jobs
        except BaseException:
            self.sock.close()
            raise
        if not options.api_keys() and not _loopback(options.host):
            logger.warning(
                "listening on %s without an API key: anyone who reaches this port can submit jobs", options.host
            )
        self.events = JobEvents()
        try:
            self.store, recovered = _open_store(output, self.events)
        except BaseException:
            self.sock.close()
            os.close(self._lock)
            raise
        if recovered:
            logger.info("marked %d job(s) left queued or running by the previous server as failed", recovered)
        self.service = Service(options.max_queue)
        self.board = ReplicaBoard(engine.layout.replicas)
        self.admission = Admission(
            model=engine.model,
            model_id=engine.model.path.name,
            limits=options.limits,
            output=output,
            adapters=frozenset(options.lora_adapters),
            presets=presets,
        )
        self.loop: EngineLoop | ReplicaPool | None = None
        self.http: HttpServer | None = None

    def start_http(self, engine: ResolvedEngine, options: ServeOptions) -> None:
        from distvideo.serving.app import AppContext, create_app

        ctx = AppContext(
            service=self.service,
            store=self.store,
            admission=self.admission,
            cancel_running=lambda job_id: self.loop is not None and self.loop.cancel(job_id),
            executor=engine.executor,
            world_size=engine.world_size,
            events=self.events,
            api_keys=options.api_keys(),
            max_body_bytes=options.max_body_bytes,
            board=self.board,
        )
        self.http = HttpServer(create_app(ctx), self.sock)
        self.http.start()
        print(f"distvideo serve: listening on {self.http.url} (host {socket.gethostname()})", flush=True)

    def close(self) -> None:
        if self.http is not None:
            self.http.stop()
        else:
            self.sock.close()
        self.store.close()
        os.close(self._lock)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, or a ConfigError naming --host and --port (a name that does not resolve, an address not
    on this machine, a port in use or not allowed)."""
    try:
        return bind(host, port)
    except OSError as exc:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there: {exc}") from None


def _open_output(output: Path) -> int:
    """Make the output folder (with its missing parents) and lock it: the lock's file descriptor, or a ConfigError
    naming --output (a file in the way, a folder not writable, a name too long); on failure nothing made is left."""
    check_output_target(output / "jobs.lock", name="--output")
    missing = [p for p in (output, *output.parents) if not os.path.lexists(p)]
    try:
        output.mkdir(parents=True, exist_ok=True)
        return _lock_output(output)
    except OSError as exc:
        lock = output / "jobs.lock"
        if missing and os.path.lexists(lock):
            lock.unlink(missing_ok=True)
        for made in missing:  # deepest first; a folder someone else filled meanwhile stays
            with contextlib.suppress(OSError):
                made.rmdir()
        raise ConfigError(f"--output {output}: cannot use it for the videos and the job store: {exc}") from None


def _open_store(output: Path, events: JobEvents) -> tuple[JobStore, int]:
    """The folder's job store, watched by `events`, with the jobs a previous server left unfinished marked failed (and
    how many); a file there that is not a job store this server can use is a ConfigError naming --output."""
    store = None
    try:
        store = JobStore(output / STORE_NAME)
        store.watch(events.publish)
        return store, store.recover("the server stopped before this job finished; submit it again")
    except sqlite3.Error as exc:
        if store is not None:
            store.close()
        raise ConfigError(
            f"--output {output}: its {STORE_NAME} is not a job store this server can use ({exc}); move it away or "
            "choose another folder"
        ) from None


def _check_adapters(engine: ResolvedEngine, adapters: dict[str, str]) -> None:
    """Every --lora-adapter file, checked before anything is made or loaded where this host is where every rank reads
    it (inline, mp). Launched and Ray ranks may be on other hosts: theirs check together when they load them."""
    if engine.launch is not None or engine.executor not in ("inline", "mp"):
        return
    for name, path in adapters.items():
        try:
            resolve_lora_path(path)
        except ConfigError as exc:
            raise ConfigError(f"--lora-adapter {name}={path}: {exc}") from None


def _lock_output(output: Path) -> int:
    fd = os.open(output / "jobs.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"--output {output}: another distvideo serve uses this folder (its job store); give each server its own"
        ) from None
    return fd


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(config: EngineConfig, options: ServeOptions, presets: dict[str, Any] | None = None) -> int:
    """Run the service until a stop signal (exit 0) or an engine failure (exit 1); bad flags raise ConfigError (exit
    2) before anything starts."""
    base_lora = list(config.lora)
    # adapters are the service's (adapters.py); with no layout option, the layout that serves the most jobs per
    # second (replicas count), except with request-selectable adapters, which one replica alone can switch
    objective = "latency" if options.lora_adapters else "throughput"
    engine = resolve_engine(dataclasses.replace(config, lora=[]), objective=objective)
    replicas = engine.layout.replicas
    if replicas > 1 and options.lora_adapters:
        raise ConfigError(
            f"--lora-adapter with --replicas {replicas}: request-selectable adapters switch the weights of every "
            "rank between jobs, which replicas running different jobs at once cannot share; serve them with "
            "--replicas 1, or load fixed adapters with --lora (every job gets them)"
        )
    _check_adapters(engine, options.lora_adapters)
    rank = engine.launch.rank if engine.launch is not None else 0
    rank0 = Frontend(engine, options, dict(presets or {})) if rank == 0 else None
    stop = threading.Event()
    stop_reason: list[str] = []
    channel: JobChannel | None = None

    def on_stop(name: str, count: int) -> None:
        logger.info("%s received%s", name, "" if count == 1 else f" ({count} times)")
        grace = options.shutdown_grace if count == 1 else 0.0  # a second signal: stop the running job now
        stop_reason.append(name)
        stop.set()
        if count == 1:
            StopSignals.hard_exit_after(options.shutdown_grace + HARD_EXIT_MARGIN_S, 1)
        if rank0 is not None:
            if rank0.loop is not None:
                rank0.loop.begin_shutdown(name, grace)
            else:
                rank0.service.close("stopping", f"shutting down ({name})")
        elif channel is not None:
            channel.request_stop(name)

    signals = StopSignals(on_stop).install()
    gen = None
    private: PrivateStore | None = None
    try:
        if rank0 is not None:
            logger.info("serve: %s", describe(options))
            rank0.start_http(engine, options)
        from distvideo.generator import VideoGenerator

        gen = VideoGenerator.from_engine(engine)
        adapters = Adapters(gen, base_lora, options.lora_adapters)
        adapters.load()
        if engine.launch is not None and engine.world_size > 1:
            channel = JobChannel.open(gen, engine.launch)
        spec, private = _replica_spec(gen, channel) if replicas > 1 else (None, None)
        if rank0 is None:
            assert channel is not None
            if stop.is_set():
                channel.request_stop(stop_reason[0])
            if spec is not None:
                gen.collective_rpc(run_replica, args=(spec,))
                code = 0
            else:
                code = follow(gen, channel, adapters)
            print(f"distvideo serve: rank {rank} stopped", flush=True)
            return code
        loop: EngineLoop | ReplicaPool = (
            EngineLoop(gen, rank0.service, rank0.store, adapters, channel, rank0.board)
            if spec is None
            else ReplicaPool(gen, rank0.service, rank0.store, rank0.board, spec)
        )
        return _run_rank0(rank0, loop, gen, channel, stop, stop_reason, options)
    except ProcessGroupBrokenError as exc:
        print(f"distvideo serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if gen is not None:
            gen.shutdown()
        if private is not None:  # the replicas' store under mp, removed once every replica stopped
            private.close()
        if rank0 is not None:
            rank0.close()
        signals.restore()


def _replica_spec(gen: VideoGenerator, channel: JobChannel | None) -> tuple[ReplicaSpec, PrivateStore | None]:
    """Where the replicas meet rank 0: the launcher's store under this session's namespace; the executor's own TCPStore
    where its ranks meet through one (Ray over several nodes: rank 0's, which this process reaches too); else (mp, Ray
    on the driver's node) a private file store of this user's (returned too: the caller removes it when the service
    stops)."""
    if channel is not None:
        env = channel.env
        return ReplicaSpec(StoreAddress(env.master_addr, env.master_port), f"{channel.namespace}/replicas"), None
    session = f"serve/{secrets.token_hex(8)}/replicas"
    address = gen.executor.rendezvous_store()
    if address is not None:
        return ReplicaSpec(address, session), None
    private = PrivateStore()
    return ReplicaSpec(private.address, session), private


def _run_rank0(
    rank0: Frontend,
    loop: EngineLoop | ReplicaPool,
    gen: GeneratorHandle,
    channel: JobChannel | None,
    stop: threading.Event,
    stop_reason: list[str],
    options: ServeOptions,
) -> int:
    rank0.loop = loop
    if channel is not None:
        channel.watch_stop_requests(lambda reason: loop.begin_shutdown(reason, options.shutdown_grace))
    if stop.is_set():  # a signal during loading
        loop.begin_shutdown(stop_reason[0], options.shutdown_grace)
    else:
        rank0.service.set_ready()
        replicas = rank0.board.replicas
        shown = f", {replicas} replicas" if replicas > 1 else ""
        print(f"distvideo serve: ready ({gen.engine.executor}, {gen.world_size} rank(s){shown})", flush=True)
    code = loop.run()
    if channel is not None and isinstance(loop, ReplicaPool):
        channel.request_stop("the service stopped")  # wakes rank 0's own stop watcher
    if code != 0:
        print(f"distvideo serve: error: {rank0.service.health_detail}", file=sys.stderr, flush=True)
    elif rank0.service.health != UNHEALTHY:
        print("distvideo serve: stopped" + (" (rank 0)" if channel is not None else ""), flush=True)
    return code
