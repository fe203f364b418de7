"""Live progress of each job for `GET /v1/videos/{id}/events` (server-sent events).

The job store tells this hub of every write it makes (`JobStore.watch`), so every status a client can read also
arrives as an event: `queued`, `started`, `progress` (step k of n), then `completed` or `failed`, which ends the
stream. The store stays the one place status is written; this hub only fans it out. Each job keeps its history (a
stream that starts late replays it first, without a gap or a repeat), for the most recent `KEEP_JOBS` jobs; a job
older than that, or finished before a restart, gives one event built from its stored row.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from distvideo.serving.store import COMPLETED, FAILED, IN_PROGRESS, QUEUED, JobRecord

KEEP_JOBS = 256  # jobs whose event history stays in memory
FINAL = ("completed", "failed")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[dict[str, Any]]


@dataclass
class _History:
    events: list[dict[str, Any]] = field(default_factory=list)
    streams: list[_Stream] = field(default_factory=list)


def event_of(
    record: JobRecord, step: int | None = None, steps: int | None = None, replica: int | None = None
) -> dict[str, Any] | None:
    """The event a store write stands for: its kind, the job id, and what changed (None for a write that is not
    news, such as a deletion)."""
    event: dict[str, Any] = {"video_id": record.id, "status": record.status, "progress": record.progress}
    if record.status == QUEUED:
        event["type"] = "queued"
    elif record.status == IN_PROGRESS and step is None:
        event["type"] = "started"
        if replica is not None:
            event["replica"] = replica
    elif record.status == IN_PROGRESS:
        event |= {"type": "progress", "step": step, "steps": steps}
    elif record.status == COMPLETED:
        event["type"] = "completed"
    elif record.status == FAILED:
        event |= {"type": "failed", "error": {"code": record.error_code, "message": record.error_message}}
    else:
        return None
    return event


class JobEvents:
    """Thread-safe: the engine loop's and the handlers' threads publish; asyncio handlers stream."""

    def __init__(self, keep_jobs: int = KEEP_JOBS):
        self._lock = threading.Lock()
        self._jobs: collections.OrderedDict[str, _History] = collections.OrderedDict()
        self._keep = keep_jobs

    def publish(
        self, record: JobRecord, step: int | None = None, steps: int | None = None, replica: int | None = None
    ) -> None:
        event = event_of(record, step, steps, replica)
        if event is None:
            return
        with self._lock:
            history = self._jobs.get(record.id)
            if history is None:
                history = self._jobs[record.id] = _History()
                while len(self._jobs) > self._keep:
                    self._forget_oldest()
            if history.events and history.events[-1]["type"] in FINAL:
                return  # a job ends once
            history.events.append(event)
            streams = list(history.streams)
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, event)

    def _forget_oldest(self) -> None:
        for job_id, history in self._jobs.items():
            if not history.streams:  # a job someone is watching stays
                del self._jobs[job_id]
                return
        self._jobs.popitem(last=False)

    async def follow(self, record: JobRecord) -> AsyncIterator[dict[str, Any]]:
        """The job's events so far, then each new one, until it completed or failed."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            history = self._jobs.get(record.id)
            if history is None:  # from before a restart, or long ago: its stored state is all there is
                past = [event_of(record)]
            else:
                past = list(history.events)
                history.streams.append(stream)
        try:
            for event in past:
                if event is not None:
                    yield event
                    if event["type"] in FINAL:
                        return
            if history is None:
                return
            while True:
                event = await stream.queue.get()
                yield event
                if event["type"] in FINAL:
                    return
        finally:
            if history is not None:
                with self._lock:
                    if stream in history.streams:
                        history.streams.remove(stream)
