"""The service's side of every rank when it runs data-parallel replicas (`distvideo serve --replicas N`): one long
`collective_rpc` in which each replica takes its jobs from rank 0 through the rendezvous store and runs them, one at a
time, independently of the other replicas.

Messages are JSON under one namespace of the store (`executors/store.py`), never pickles:

- `r<k>/job/<n>`: rank 0 -> every rank of replica k: its n-th job `{"kind": "job", "id", "request"}` (the resolved
  ResolvedRequest's fields) or `{"kind": "stop"}`.
- `r<k>/cancel/<n>`: set by rank 0 to stop job n of replica k; its ranks read it between denoising steps (and decide
  together, so they stop at the same step).
- `r<k>/ev/<m>`: replica k's output rank -> rank 0, in order: `progress` (step done of total), `completed` (the video's
  file name, timings), `failed` (error type and message), `stopped`.

A job runs through the batch path (`Worker.execute_batch` with a share for this replica alone), so a replica's ranks
run exactly the forward a batch item runs; its output rank writes the video where the request names it (on the
service's output folder, which several nodes must share) and reports the file name. Same request, same layout: the
same bytes on any replica.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from distvideo.errors import ProcessGroupBrokenError, WorkerDiedError
from distvideo.executors.store import StoreAddress, StoreChannel, connect_to
from distvideo.media import write_video
from distvideo.request import ResolvedRequest

if TYPE_CHECKING:
    from distvideo.outputs import ItemOutcome

logger = logging.getLogger(__name__)

#: one store wait for the next job; an idle replica simply waits again
WAIT = timedelta(hours=6)
#: errors after which a rank cannot run another job: the call ends and the service exits nonzero
FATAL = (WorkerDiedError, ProcessGroupBrokenError)


@dataclass(frozen=True)
class ReplicaSpec:
    """Where the replicas' messages are: the store's address and the service session's namespace."""

    address: StoreAddress
    namespace: str


def job_key(replica: int, n: int) -> str:
    return f"r{replica}/job/{n}"


def cancel_key(replica: int, n: int) -> str:
    return f"r{replica}/cancel/{n}"


def event_key(replica: int, m: int) -> str:
    return f"r{replica}/ev/{m}"


def wait_json(store: StoreChannel, key: str, where: str) -> dict[str, Any]:
    """The JSON value of `key`, waiting for it as long as it takes; ProcessGroupBrokenError once the store is gone."""
    while True:
        try:
            store.wait([key], WAIT)
            message: dict[str, Any] = json.loads(store.get(key))
            return message
        except dist.DistStoreError:
            continue  # nothing within WAIT: wait again
        except dist.DistError as exc:
            raise ProcessGroupBrokenError(
                f"{where}: the rendezvous store is unreachable while waiting for {key} "
                f"({str(exc).splitlines()[0]}): rank 0 (or the launcher's agent) is gone; restart the service"
            ) from exc


class _Reporter:
    """A replica's output rank: its events to rank 0, numbered in order."""

    def __init__(self, store: StoreChannel, replica: int):
        self.store, self.replica = store, replica
        self._sent = 0

    def send(self, event: dict[str, Any]) -> None:
        self._sent += 1
        self.store.set(event_key(self.replica, self._sent), json.dumps(event))


class _StepWatch:
    """The `cancelled` function a job's forward receives. The step control asks it once after every denoising step,
    after the step is done, so the n-th question also says that step n is done: the output rank reports it as
    progress (the batch path passes no progress callback). The answer: whether rank 0 asked this job to stop."""

    def __init__(self, store: StoreChannel, key: str, reporter: _Reporter | None, job_id: str, total: int):
        self.store, self.key, self.reporter, self.job_id, self.total = store, key, reporter, job_id, total
        self.done = 0

    def __call__(self) -> bool:
        self.done += 1
        if self.reporter is not None:
            self.reporter.send({"kind": "progress", "id": self.job_id, "done": self.done, "total": self.total})
        return self.store.has(self.key)


def run_replica(worker: Any, spec: ReplicaSpec) -> int:
    """Run on every rank by `collective_rpc`: this rank's replica's jobs, until rank 0 says stop. Returns how many
    jobs the replica ran."""
    store = connect_to(spec.address, spec.namespace)
    replica = int(worker.replica)
    reporter = _Reporter(store, replica) if worker.is_output_rank else None
    where = f"rank {worker.rank} (replica {replica})"
    ran = 0
    try:
        for n in itertools.count(1):
            message = wait_json(store, job_key(replica, n), where)
            if message["kind"] == "stop":
                if reporter is not None:
                    reporter.send({"kind": "stopped"})
                return ran
            _run_job(worker, store, replica, n, message, reporter)
            ran += 1
    finally:
        store.close()
    return ran


def _run_job(
    worker: Any, store: StoreChannel, replica: int, n: int, message: dict[str, Any], reporter: _Reporter | None
) -> None:
    job_id = str(message["id"])
    request = ResolvedRequest(**message["request"])  # resolved by admission, which named its file
    target = Path(str(request.output_path))
    work = dataclasses.replace(request, save_video=False, return_frames=True, output_path=None)
    shares: list[list[tuple[int, ResolvedRequest]]] = [[] for _ in range(replica)] + [[(n, work)]]
    watch = _StepWatch(store, cancel_key(replica, n), reporter, job_id, request.num_inference_steps)
    outcomes: list[ItemOutcome] = []
    try:
        worker.execute_batch(shares, emit=outcomes.append, cancelled=watch)
    except FATAL:
        raise
    except Exception as exc:  # this job fails alone; the replica goes on with its next one
        logger.warning("job %s failed on replica %d: %s: %s", job_id, replica, type(exc).__name__, exc)
        if reporter is not None:
            reporter.send({"kind": "failed", "id": job_id, "error_type": type(exc).__name__, "error": str(exc)})
        return
    if reporter is None:
        return
    outcome = outcomes[0] if outcomes else None
    if outcome is None or outcome.output is None or outcome.output.frames is None:
        error_type = outcome.error_type if outcome is not None and outcome.error_type else "RuntimeError"
        error = outcome.error if outcome is not None and outcome.error else "no frames came back"
        reporter.send({"kind": "failed", "id": job_id, "error_type": error_type, "error": error})
        return
    start = time.perf_counter()
    try:
        video = write_video(outcome.output.frames, target, fps=request.fps)
    except Exception as exc:
        reporter.send({"kind": "failed", "id": job_id, "error_type": type(exc).__name__, "error": str(exc)})
        return
    timings = {**outcome.output.timings, "video_writing": time.perf_counter() - start}
    reporter.send({"kind": "completed", "id": job_id, "file": video.name, "timings": timings})
