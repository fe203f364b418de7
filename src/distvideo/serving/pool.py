"""Rank 0 of a service with several data-parallel replicas (`--replicas N`): it hands each admitted job to an idle
replica, in the queue's order (fair across API keys: `jobs.Service.take`), and records what the replicas report in the
job store. The replicas themselves run `replica_loop.run_replica` inside one long `collective_rpc`, which this
process's main thread makes (under a launcher rank 0 is also a rank of replica 0). Status is written here and read by
the handlers from the store only, as with one replica (runner.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from distvideo.executors.store import StoreChannel, connect_to
from distvideo.serving.board import ReplicaBoard
from distvideo.serving.drain import Drain
from distvideo.serving.jobs import UNHEALTHY, QueuedJob, Service
from distvideo.serving.replica_loop import ReplicaSpec, cancel_key, event_key, job_key, run_replica, wait_json
from distvideo.serving.store import JobStore

if TYPE_CHECKING:
    from distvideo.protocols import GeneratorHandle

logger = logging.getLogger(__name__)

#: how a replica's failure type becomes the job's error code (anything else: generation_failed)
ERROR_CODES = {"ConfigError": "invalid_request", "GenerationTimeout": "timeout"}


@dataclasses.dataclass
class _Running:
    n: int  # the job's number on its replica
    job: QueuedJob


class ReplicaPool:
    def __init__(self, gen: GeneratorHandle, service: Service, store: JobStore, board: ReplicaBoard, spec: ReplicaSpec):
        self.gen, self.service, self.store, self.board, self.spec = gen, service, store, board, spec
        self.broken: BaseException | None = None
        self._cond = threading.Condition()
        self._sent = [0] * board.replicas
        self._running: dict[int, _Running] = {}
        self._cancelled: set[str] = set()  # jobs a DELETE asked to stop
        self._drain = Drain(service, store, self._cancel_all, logger)
        self._out = connect_to(spec.address, spec.namespace)  # rank 0 -> replicas (under self._cond)

    # -- any thread ------------------------------------------------------------------------------
    def begin_shutdown(self, reason: str, grace: float) -> None:
        """Stop admission, fail the queued jobs, give the running ones `grace` seconds. Idempotent; the first reason
        stays, a later call may only shorten the grace."""
        self._drain.begin(reason, grace)

    def cancel(self, job_id: str) -> bool:
        """A client's DELETE of a running job: its replica stops it at the next step. False if it is not running (yet:
        a job the dispatcher has just taken from the queue is stopped as soon as its replica has it)."""
        with self._cond:
            self._cancelled.add(job_id)
            for replica, running in self._running.items():
                if running.job.id == job_id:
                    self._out.set(cancel_key(replica, running.n), "1")
                    return True
        return False

    def _cancel_all(self) -> None:
        with self._cond:
            for replica, running in self._running.items():
                self._out.set(cancel_key(replica, running.n), "1")

    # -- the main thread -------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until shutdown; returns the exit code (1 when the engine broke)."""
        threads = [threading.Thread(target=self._dispatch, name="distvideo-serve-dispatch", daemon=True)]
        for replica in range(self.board.replicas):
            name = f"distvideo-serve-replica-{replica}"
            threads.append(threading.Thread(target=self._collect, args=(replica,), name=name, daemon=True))
        for thread in threads:
            thread.start()
        try:
            self.gen.collective_rpc(run_replica, args=(self.spec,))
        except Exception as exc:  # a rank died or its group broke: no replica can be trusted with a job
            self._broke(exc)
        # after a clean stop every thread ends by itself; after a failure the collectors may wait on a store that
        # is gone or on replicas that are: they are daemons, and nothing they could still record is trusted
        for thread in threads if self.broken is None else threads[:1]:
            thread.join(timeout=5.0)
        return 1 if self.broken is not None else 0

    def _broke(self, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        logger.error("the engine failed; the service stops and exits 1: %s", message)
        with self._cond:
            self.broken = exc
            running, self._running = list(self._running.values()), {}
            self._cond.notify_all()
        for item in running:
            self.store.mark_failed(item.job.id, "engine_failure", message)
        for job in self.service.close(UNHEALTHY, f"the engine failed: {message}"):
            self.store.mark_failed(job.id, "engine_failure", f"the engine failed before this job started: {message}")

    # -- the dispatcher's thread -----------------------------------------------------------------
    def _dispatch(self) -> None:
        """Wait for an idle replica, then give it the next job of the queue; once the service closed and every
        replica is idle, tell every replica to stop."""
        while True:
            with self._cond:
                while len(self._running) == self.board.replicas and self.broken is None:
                    self._cond.wait()
                if self.broken is not None:
                    return
            job = self.service.take()
            if job is None:
                break
            try:
                message = json.dumps({"kind": "job", "id": job.id, "request": dataclasses.asdict(job.request)})
            except (TypeError, ValueError) as exc:  # admission resolves requests to JSON values: a bug if not
                self.store.mark_failed(job.id, "generation_failed", f"the request cannot be sent to a replica: {exc}")
                self.service.finished(job.id, "failed", 0.0, {})
                continue
            with self._cond:
                if self.broken is not None:
                    self.store.mark_failed(job.id, "engine_failure", "the engine failed before this job started")
                    return
                replica = min(r for r in range(self.board.replicas) if r not in self._running)
                self._sent[replica] += 1
                self._running[replica] = _Running(self._sent[replica], job)
                self.board.start(replica, job.id)
                self.store.mark_running(job.id, replica=replica)
                self._out.set(job_key(replica, self._sent[replica]), message)
                if job.id in self._cancelled:  # deleted between the queue and here
                    self._out.set(cancel_key(replica, self._sent[replica]), "1")
        with self._cond:
            while self._running and self.broken is None:
                self._cond.wait()
            if self.broken is not None:
                return
            for replica in range(self.board.replicas):
                self._sent[replica] += 1
                self._out.set(job_key(replica, self._sent[replica]), json.dumps({"kind": "stop"}))

    # -- one thread per replica ------------------------------------------------------------------
    def _collect(self, replica: int) -> None:
        """Record replica `replica`'s events in the store, in order, until it stopped."""
        inbox = connect_to(self.spec.address, self.spec.namespace)
        m = 0
        try:
            while self.broken is None:
                m += 1
                event = wait_json(inbox, event_key(replica, m), f"rank 0 (events of replica {replica})")
                inbox.delete(event_key(replica, m))
                if event["kind"] == "stopped":
                    return
                try:
                    self._record(inbox, replica, event)
                except Exception:  # one event that could not be recorded must not stop the replica's reports
                    logger.exception("recording %s of replica %d failed", event.get("kind"), replica)
        except Exception:
            if self.broken is None:
                logger.debug("collecting the events of replica %d failed", replica, exc_info=True)
        finally:
            inbox.close()

    def _record(self, inbox: StoreChannel, replica: int, event: dict[str, Any]) -> None:
        with self._cond:
            running = self._running.get(replica)
        if running is None or running.job.id != event.get("id"):
            return  # a job failed meanwhile by the engine's failure
        job_id, kind = running.job.id, event["kind"]
        if kind == "progress":
            done, total = int(event["done"]), int(event["total"])
            self.store.set_progress(job_id, min(99, done * 100 // max(total, 1)), step=done, steps=total)
            if self._drain.late():
                self._cancel_all()
            return
        timings: dict[str, float] = {}
        error: str | None = None
        if kind == "completed":
            outcome, timings = "completed", {k: float(v) for k, v in event.get("timings", {}).items()}
            self.store.mark_completed(job_id, str(event["file"]), timings)
        else:
            code, message = self._failure(job_id, str(event.get("error_type")), str(event.get("error")))
            outcome = "cancelled" if code in ("cancelled", "server_shutdown") else "failed"
            error = f"{event.get('error_type')}: {event.get('error')}"
            self.store.mark_failed(job_id, code, message)
        seconds = self.board.finish(replica, outcome, error)
        self.service.finished(job_id, outcome, seconds, timings)
        for key in (job_key(replica, running.n), cancel_key(replica, running.n)):
            inbox.delete(key)  # every rank of the replica read the job before its output rank could report its end
        with self._cond:
            self._running.pop(replica, None)
            self._cancelled.discard(job_id)
            self._cond.notify_all()

    def _failure(self, job_id: str, error_type: str, error: str) -> tuple[str, str]:
        if error_type in ("GenerationCancelled", "GenerationTimeout"):
            with self._cond:
                by_client = job_id in self._cancelled
            if by_client:
                return "cancelled", f"cancelled by a DELETE request ({error})"
            if (stopping := self._drain.why_stopped(error)) is not None:
                return stopping
        code = ERROR_CODES.get(error_type, "generation_failed")
        return code, error if code != "generation_failed" else f"{error_type}: {error}"
