"""GET /metrics: the Prometheus text format (version 0.0.4), from the service's counters and the job store."""

from __future__ import annotations

from distvideo.serving.board import ReplicaBoard
from distvideo.serving.jobs import OK, Service
from distvideo.serving.store import JobStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lines.append(f"{name}{labels} {value:g}" if isinstance(value, float) else f"{name}{labels} {value}")


def render(service: Service, store: JobStore, board: ReplicaBoard | None = None) -> str:
    c = service.counters
    lines: list[str] = []
    _family(
        lines,
        "distvideo_up",
        "gauge",
        "1 when the model is loaded and jobs are admitted",
        [("", int(service.health == OK))],
    )
    _family(lines, "distvideo_queue_depth", "gauge", "jobs waiting to run", [("", service.depth)])
    _family(
        lines, "distvideo_queue_capacity", "gauge", "most jobs that may wait (--max-queue)", [("", service.max_queue)]
    )
    _family(
        lines,
        "distvideo_jobs",
        "gauge",
        "jobs in the store by status",
        [(f'{{status="{status}"}}', n) for status, n in store.counts().items()],
    )
    _family(lines, "distvideo_jobs_submitted_total", "counter", "jobs admitted since start", [("", c.submitted)])
    _family(
        lines,
        "distvideo_jobs_rejected_total",
        "counter",
        "requests refused since start, by reason",
        [(f'{{reason="{reason}"}}', n) for reason, n in sorted(c.rejected.items())],
    )
    _family(
        lines,
        "distvideo_jobs_finished_total",
        "counter",
        "jobs that ended since start, by outcome",
        [(f'{{outcome="{outcome}"}}', n) for outcome, n in sorted(c.finished.items())],
    )
    stages = sorted(c.stage_seconds)
    lines.append("# HELP distvideo_stage_seconds seconds spent per stage of completed jobs")
    lines.append("# TYPE distvideo_stage_seconds summary")
    for stage in stages:
        lines.append(f'distvideo_stage_seconds_sum{{stage="{stage}"}} {c.stage_seconds[stage]:.6f}')
        lines.append(f'distvideo_stage_seconds_count{{stage="{stage}"}} {c.stage_count[stage]}')
    if board is not None:
        _replicas(lines, board)
    return "\n".join(lines) + "\n"


def _replicas(lines: list[str], board: ReplicaBoard) -> None:
    states = board.snapshot()
    _family(lines, "distvideo_replicas", "gauge", "data-parallel replicas of the engine", [("", len(states))])
    busy = sum(s.job is not None for s in states)
    _family(lines, "distvideo_replicas_busy", "gauge", "replicas running a job now", [("", busy)])
    _family(
        lines,
        "distvideo_replica_jobs_total",
        "counter",
        "jobs that ended on each replica (completed, failed or cancelled)",
        [(f'{{replica="{s.replica}"}}', s.jobs_done) for s in states],
    )
    _family(
        lines,
        "distvideo_replica_busy_seconds_total",
        "counter",
        "seconds each replica spent running jobs (the running job's time so far included)",
        [(f'{{replica="{s.replica}"}}', float(s.busy_seconds)) for s in states],
    )
