"""The one loop that owns the engine. On rank 0 (or the only process) it takes admitted jobs one at a time, tells the
other launched ranks (channel.py), runs the job, and records the outcome in the store; on every other launched rank
`follow` runs the jobs rank 0 announces. Status is written here and read by the handlers from the store only."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from distvideo.errors import (
    ConfigError,
    GenerationCancelled,
    GenerationTimeout,
    ProcessGroupBrokenError,
    WorkerDiedError,
)
from distvideo.request import ResolvedRequest
from distvideo.serving.adapters import Adapters
from distvideo.serving.board import ReplicaBoard
from distvideo.serving.channel import JobChannel
from distvideo.serving.drain import Drain
from distvideo.serving.jobs import UNHEALTHY, QueuedJob, Service
from distvideo.serving.store import JobStore

if TYPE_CHECKING:
    from distvideo.protocols import GeneratorHandle

logger = logging.getLogger(__name__)

#: errors after which the engine cannot run another job: the process exits nonzero so it is restarted
FATAL = (WorkerDiedError, ProcessGroupBrokenError)
#: how often the engine loop asks the generator, while no job runs, whether its ranks are still there
HEALTH_POLL_S = 1.0


class EngineLoop:
    def __init__(
        self,
        gen: GeneratorHandle,
        service: Service,
        store: JobStore,
        adapters: Adapters,
        channel: JobChannel | None = None,
        board: ReplicaBoard | None = None,
    ):
        self.gen, self.service, self.store, self.adapters, self.channel = gen, service, store, adapters, channel
        self.board = board or ReplicaBoard(1)
        self.broken: BaseException | None = None
        self._drain = Drain(service, store, self._cancel_if_late, logger)

    # -- any thread ------------------------------------------------------------------------------
    def begin_shutdown(self, reason: str, grace: float) -> None:
        """Stop admission, fail the queued jobs, give the running one `grace` seconds. Idempotent; the first reason
        stays, a later call may only shorten the grace."""
        self._drain.begin(reason, grace)

    def cancel(self, job_id: str) -> bool:
        """A client's DELETE of the running job: stop it at its next denoising step. False if it is not running."""
        if not self.service.request_cancel(job_id):
            return False
        self.gen.cancel()  # if the request has not reached its first step yet, the progress callback repeats this
        return True

    def _cancel_if_late(self) -> None:
        if self.service.running is not None:
            self.gen.cancel()

    # -- the engine's thread ---------------------------------------------------------------------
    def run(self) -> int:
        """Run jobs until shutdown; returns the exit code (1 when the engine broke)."""
        idle_watch = threading.Event()
        threading.Thread(target=self._watch_health, args=(idle_watch,), name="distvideo-health", daemon=True).start()
        try:
            while (job := self.service.take()) is not None:
                self._run(job)
                if self.broken is not None:
                    break
        finally:
            idle_watch.set()
            if self.channel is not None and self.broken is None:
                missing = self.channel.stop_everyone(self._drain.reason or "stopped")
                if missing:
                    logger.warning("ranks %s did not confirm the stop", missing)
            if self.channel is not None:
                self.channel.request_stop("the service stopped")  # wakes rank 0's own stop watcher
        return 1 if self.broken is not None else 0

    def _run(self, job: QueuedJob) -> None:
        self.store.mark_running(job.id)
        self.board.start(0, job.id)
        start, outcome, timings, error = time.monotonic(), "failed", {}, None
        try:
            if self.channel is not None:
                fields = dataclasses.asdict(job.request)
                self.channel.publish({"kind": "job", "id": job.id, "request": fields, "lora": job.lora})
            self.adapters.for_job(job.lora)
            result = self.gen.generate_request(job.request, on_progress=lambda d, t: self._progress(job.id, d, t))
        except GenerationCancelled as exc:
            outcome, error = "cancelled", f"{type(exc).__name__}: {exc}"
            self.store.mark_failed(job.id, *self._why_stopped(job.id, exc))
        except FATAL as exc:
            error = f"{type(exc).__name__}: {exc}"
            self._broke(job.id, exc)
        except ConfigError as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.store.mark_failed(job.id, "invalid_request", str(exc))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("job %s failed: %s: %s", job.id, type(exc).__name__, exc)
            self.store.mark_failed(job.id, "generation_failed", f"{type(exc).__name__}: {exc}")
        else:
            assert result.video_path is not None  # this process holds the output rank
            outcome, timings = "completed", dict(result.timings)
            self.store.mark_completed(job.id, Path(result.video_path).name, timings)
        finally:
            self.board.finish(0, outcome, error)
            self.service.finished(job.id, outcome, time.monotonic() - start, timings)

    def _progress(self, job_id: str, done: int, total: int) -> None:
        percent = min(99, done * 100 // max(total, 1))  # 100 once the file is written
        self.store.set_progress(job_id, percent, step=done, steps=total)
        if self.service.cancel_requested(job_id) or self._drain.late():
            self.gen.cancel()  # inside the request: it stops after this step on every rank

    def _why_stopped(self, job_id: str, exc: GenerationCancelled) -> tuple[str, str]:
        if self.service.cancel_requested(job_id):
            return "cancelled", f"cancelled by a DELETE request ({exc})"
        if (stopping := self._drain.why_stopped(exc)) is not None:
            return stopping
        if isinstance(exc, GenerationTimeout):
            return "timeout", str(exc)
        return "cancelled", str(exc)

    def _watch_health(self, stopped: threading.Event) -> None:
        """While no job runs, ask the generator whether its ranks are still there (mp: a worker that died while idle),
        so /health turns unhealthy and the loop exits 1 then, not at the next job. A job's own failure is `_run`'s."""
        while not stopped.wait(HEALTH_POLL_S):
            if self.service.running is not None:
                continue
            try:
                self.gen.check_health()
            except FATAL as exc:
                message = f"{type(exc).__name__}: {exc}"
                logger.error("the engine failed while idle; the service stops and exits 1: %s", message)
                self.broken = exc
                self._fail_queued(message)
                return
            except Exception:
                return  # shut down or dead already: whoever did that reports it

    def _fail_queued(self, message: str) -> None:
        for job in self.service.close(UNHEALTHY, f"the engine failed: {message}"):
            self.store.mark_failed(job.id, "engine_failure", f"the engine failed before this job started: {message}")

    def _broke(self, job_id: str, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        logger.error("the engine failed during job %s; the service stops and exits 1: %s", job_id, message)
        self.broken = exc
        self.store.mark_failed(job_id, "engine_failure", message)
        self._fail_queued(message)


def follow(gen: GeneratorHandle, channel: JobChannel, adapters: Adapters) -> int:
    """A launched rank other than 0: run every job rank 0 announces, with the same request, until it says stop."""
    while True:
        message = channel.receive()
        if message["kind"] == "stop":
            logger.debug("rank 0 stopped the service: %s", message.get("reason"))
            channel.acknowledge_stop()
            return 0
        lora = message.get("lora")
        try:
            adapters.for_job((str(lora[0]), float(lora[1])) if lora else None)
            gen.generate_request(ResolvedRequest(**message["request"]))
        except FATAL:
            raise
        except Exception as exc:  # the same error reached rank 0, which records it
            logger.debug("job %s ended with %s: %s", message.get("id"), type(exc).__name__, exc)
