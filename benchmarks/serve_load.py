"""Load on `distvideo serve`: C concurrent clients submit J jobs in all, one at a time each: a client follows its job
to the end before submitting the next; a 429 is that job's answer (counted, not retried: the client waits Retry-After
before its next job). Every status call a client makes (every `poll_s` from its submission to the job's end) is timed.
With `first_event`, each client also follows the job's event stream from right after the POST returned: its first
event is timed from that moment (the latency after submission) and from before the POST, and the stream's `started`
and final events say when each replica was busy, so the status calls made while every replica ran a job are reported
apart. Each client makes one untimed call first, so the client library's own lazy imports and connection set-up are
not counted as the server's latency, and the clients (threads of this process) start together.

    .venv/bin/python benchmarks/serve_load.py                       # an inline server on the tiny random-weight model, port 0
    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 10 --jobs 40
    .venv/bin/python benchmarks/serve_load.py --compare-replicas    # 2 mp ranks: --replicas 2 vs 1, 16 jobs, 8 clients

Prints one JSON report: jobs accepted / refused with 429 / completed / failed / lost / run more than once (a job whose
event history starts twice), duplicated ids, jobs per second, the status latency (samples, p50, p90, p99, max in ms)
while the client's own job generated and, with `first_event`, while every replica was busy, the POST's latency, and
the first event's latency after the POST returned and from before it. Clients use the official OpenAI SDK
(`openai`) when it is installed (`--client openai`), else httpx. tests/test_serving_load.py runs the same function. Figures belong in docs/BENCHMARKS.md with the
command and the machine, measured on a machine that is not busy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

JOB = {"prompt": "a lantern on a quiet river", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
# --compare-replicas: a job whose denoising outweighs the per-job overhead, so the replicas' speed-up shows
REPLICA_JOB = {**JOB, "size": "48x32", "num_frames": 9, "num_inference_steps": 8}
SDK_FIELDS = ("prompt", "size", "seconds", "model")  # what OpenAI's videos.create takes; the rest goes as extra_body


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "samples": len(values),
        "p50": round(_percentile(values, 0.50), 2),
        "p90": round(_percentile(values, 0.90), 2),
        "p99": round(_percentile(values, 0.99), 2),
        "max": round(max(values, default=float("nan")), 2),
    }


class _HttpxClient:
    """The jobs API through httpx: submit -> (status code, job id or error text, Retry-After); status -> str."""

    def __init__(self, url: str, headers: dict[str, str]):
        self.http = httpx.Client(base_url=url, headers=headers, timeout=120.0)

    def submit(self, body: dict[str, Any]) -> tuple[int, str, float]:
        response = self.http.post("/v1/videos", json=body)
        text = response.json()["id"] if response.status_code == 200 else response.text[:200]
        return response.status_code, text, float(response.headers.get("retry-after", 1))

    def warm_up(self) -> None:
        self.http.get("/v1/models").raise_for_status()

    def status(self, job_id: str) -> str:
        return str(self.http.get(f"/v1/videos/{job_id}").json()["status"])

    def close(self) -> None:
        self.http.close()


class _OpenAIClient:
    """The same through the official OpenAI SDK (`client.videos.create / retrieve`); our fields ride in extra_body."""

    def __init__(self, url: str, headers: dict[str, str]):
        import openai

        key = headers.get("Authorization", "Bearer none").split(" ", 1)[1]
        self.openai = openai
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120.0)

    def submit(self, body: dict[str, Any]) -> tuple[int, str, float]:
        known = {k: v for k, v in body.items() if k in SDK_FIELDS}
        extra = {k: v for k, v in body.items() if k not in SDK_FIELDS}
        try:
            return 200, self.client.videos.create(**known, extra_body=extra).id, 0.0
        except self.openai.APIStatusError as exc:
            return exc.status_code, str(exc)[:200], float(exc.response.headers.get("retry-after", 1))

    def warm_up(self) -> None:
        """The SDK imports its videos resource on first use (about 40 ms, under the import lock every client thread
        shares): done here, with the connection opened, before anything is timed."""
        assert self.client.videos is not None
        self.client.models.list()

    def status(self, job_id: str) -> str:
        return str(self.client.videos.retrieve(job_id).status)

    def close(self) -> None:
        self.client.close()


def default_client() -> str:
    return "openai" if importlib.util.find_spec("openai") is not None else "httpx"


@dataclass
class _Followed:
    """What a job's event stream showed, in `time.perf_counter()` seconds: its first event, when it started (on which
    replica) and when it ended (None: not seen)."""

    first: float | None = None
    started: float | None = None
    replica: int = 0
    ended: float | None = None


def _follow(http: httpx.Client, job_id: str, seen: _Followed) -> None:
    """Read the job's event stream to its end (on the client's own connection, opened before: a new connection's
    set-up is not the server's latency), noting the times in `seen`."""
    with http.stream("GET", f"/v1/videos/{job_id}/events") as response:
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            seen.first = seen.first or now
            event = json.loads(line[len("data:") :])
            if event["type"] == "started":
                seen.started, seen.replica = now, int(event.get("replica", 0))
            elif event["type"] in ("completed", "failed"):
                seen.ended = now


def _all_busy(followed: list[_Followed], replicas: int) -> list[tuple[float, float]]:
    """The intervals in which every one of `replicas` replicas ran a job (from the streams' started and end events)."""
    edges = sorted(
        (t, step, f.replica)
        for f in followed
        if f.started is not None and f.ended is not None
        for t, step in ((f.started, 1), (f.ended, -1))
    )
    busy: dict[int, int] = {}
    intervals: list[tuple[float, float]] = []
    since: float | None = None
    for t, step, replica in edges:
        busy[replica] = busy.get(replica, 0) + step
        every = sum(n > 0 for n in busy.values()) >= replicas
        if every and since is None:
            since = t
        elif not every and since is not None:
            intervals.append((since, t))
            since = None
    return intervals


def _starts(url: str, headers: dict[str, str], job_id: str) -> int:
    """How many times the job's replayed event history says it started (1 for a job run once)."""
    with httpx.stream("GET", f"{url}/v1/videos/{job_id}/events", headers=headers, timeout=120.0) as response:
        return sum('"type":"started"' in line.replace(" ", "") for line in response.iter_lines())


@dataclass
class _Tally:
    """What the clients saw: every status call (when it started, ms, the status it read), each POST's ms, and each
    accepted job's (id, before the POST, POST returned, first event, started, replica, ended) in perf_counter s."""

    accepted: list[str] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    final: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[float, float, str]] = field(default_factory=list)
    posts_ms: list[float] = field(default_factory=list)
    followed: list[tuple[str, float, float, float | None, float | None, int, float | None]] = field(
        default_factory=list
    )


@dataclass
class _Load:
    url: str
    headers: dict[str, str]
    body: dict[str, Any]
    client: str
    poll_s: float
    deadline: float  # time.monotonic()
    first_event: bool


def _one_client(load: _Load, next_index: Callable[[], int | None], tally: _Tally, lock: Any, go: Any) -> None:
    """One client: once every client is ready (`go`, a barrier), submit the next job, follow it to its end (status
    calls; with first_event its event stream too), until no job is left."""
    api = (_OpenAIClient if load.client == "openai" else _HttpxClient)(load.url, load.headers)
    events = httpx.Client(base_url=load.url, headers=load.headers, timeout=120.0)
    try:
        api.warm_up()
        events.get("/health")  # opens the stream's connection
        go.wait()
        while (index := next_index()) is not None:
            submitted = time.perf_counter()
            code, job_id, retry_after = api.submit({**load.body, "seed": index})
            returned = time.perf_counter()
            if code == 429:  # that job's answer; the client waits as told before its next one
                with lock:
                    tally.refused.append(index)
                time.sleep(min(retry_after, 30.0))
                continue
            if code != 200:
                with lock:
                    tally.errors.append(f"job {index}: POST {code} {job_id}")
                continue
            with lock:
                tally.accepted.append(job_id)
                tally.posts_ms.append((returned - submitted) * 1000)
            seen = _Followed()
            reader = threading.Thread(target=_follow, args=(events, job_id, seen), daemon=True)
            if load.first_event:
                reader.start()
            while time.monotonic() < load.deadline:
                start = time.perf_counter()
                status = api.status(job_id)
                with lock:
                    tally.calls.append((start, (time.perf_counter() - start) * 1000, status))
                if status in ("completed", "failed"):
                    with lock:
                        tally.final[job_id] = status
                    break
                time.sleep(load.poll_s)
            if load.first_event:
                reader.join(timeout=max(0.0, load.deadline - time.monotonic()))
                with lock:
                    tally.followed.append(
                        (job_id, submitted, returned, seen.first, seen.started, seen.replica, seen.ended)
                    )
    finally:
        api.close()
        events.close()


def _run_clients(load: _Load, clients: int, jobs: int) -> _Tally:
    """`clients` clients, threads of this process, that start together once each made its untimed first call."""
    tally, lock, go = _Tally(), threading.Lock(), threading.Barrier(clients)
    indices = iter(range(jobs))

    def next_index() -> int | None:
        with lock:
            return next(indices, None)

    threads = [
        threading.Thread(target=_one_client, args=(load, next_index, tally, lock, go), name=f"client-{i}")
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally


def run_load(
    url: str,
    *,
    clients: int = 10,
    jobs: int = 40,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    poll_s: float = 0.1,
    timeout_s: float = 900.0,
    client: str = "httpx",
    first_event: bool = False,
    replicas: int = 1,
) -> dict[str, Any]:
    load = _Load(url, dict(headers or {}), dict(body or JOB), client, poll_s, time.monotonic() + timeout_s, first_event)
    started = time.monotonic()
    tally = _run_clients(load, clients, jobs)
    wall = time.monotonic() - started
    statuses = list(tally.final.values())
    starts = [_starts(url, load.headers, job_id) for job_id in tally.final] if first_event else []
    report = {
        "client": client,
        "clients": clients,
        "jobs_submitted": jobs,
        "accepted": len(tally.accepted),
        "refused_429": len(tally.refused),
        "completed": statuses.count("completed"),
        "failed": statuses.count("failed"),
        "lost": len(set(tally.accepted) - set(tally.final)),
        "duplicated_ids": len(tally.accepted) - len(set(tally.accepted)),
        "errors": tally.errors,
        "accepted_ids": tally.accepted,
        "run_twice": sum(n > 1 for n in starts),
        "wall_s": round(wall, 2),
        "jobs_per_s": round(statuses.count("completed") / wall, 3) if wall > 0 else float("nan"),
        "post_ms": _summary(tally.posts_ms),
        "status_latency_while_generating_ms": _summary([ms for _, ms, s in tally.calls if s == "in_progress"]),
    }
    if first_event:
        seen = [_Followed(first, start, replica, end) for _, _, _, first, start, replica, end in tally.followed]
        busy = _all_busy(seen, replicas)
        during = [ms for t, ms, _ in tally.calls if any(a <= t < b for a, b in busy)]
        firsts = [(first, before, after) for _, before, after, first, *_ in tally.followed if first is not None]
        report |= {
            "replicas": replicas,
            "all_replicas_busy_s": round(sum(b - a for a, b in busy), 2),
            "status_latency_all_replicas_busy_ms": _summary(during),
            "first_event_after_post_ms": _summary([(first - after) * 1000 for first, _, after in firsts]),
            "first_event_from_before_post_ms": _summary([(first - before) * 1000 for first, before, _ in firsts]),
        }
    return report


@contextmanager
def local_server(max_queue: int, engine: Sequence[str] = ("--executor", "inline")) -> Iterator[str]:
    """A `distvideo serve` (inline unless `engine` says otherwise) on the tiny random-weight model, on a port it
    chooses; yields its URL."""
    from distvideo.models.embedded import tiny_model_path

    distvideo = Path(sys.executable).parent / "distvideo"
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        cmd = [str(distvideo), "serve", *engine, "--port", "0", "--output", folder, "--no-progress"]
        cmd += ["--model", str(tiny_model_path())]
        with log.open("wb") as sink:
            proc = subprocess.Popen([*cmd, "--max-queue", str(max_queue)], stdout=sink, stderr=subprocess.STDOUT)
        try:
            while "distvideo serve: ready" not in log.read_text():
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited:\n{log.read_text()}")
                time.sleep(0.1)
            match = re.search(r"listening on (http://\S+)", log.read_text())
            assert match is not None
            yield match.group(1)
        finally:
            proc.terminate()
            proc.wait(timeout=120)


def compare_replicas(clients: int, jobs: int, client: str, ranks: int = 2) -> dict[str, Any]:
    """The same load on `ranks` mp ranks served as one replica and as `ranks` replicas; jobs/s and their ratio."""
    reports: dict[str, Any] = {}
    for replicas in (1, ranks):
        engine = ("--executor", "mp", "--num-gpus", str(ranks), "--replicas", str(replicas))
        with local_server(max_queue=jobs, engine=engine) as url:
            report = run_load(
                url,
                clients=clients,
                jobs=jobs,
                body=REPLICA_JOB,
                client=client,
                first_event=True,
                replicas=replicas,
            )
        report.pop("accepted_ids")
        reports[f"replicas_{replicas}"] = report
    one, many = reports["replicas_1"]["jobs_per_s"], reports[f"replicas_{ranks}"]["jobs_per_s"]
    reports[f"speedup_replicas_{ranks}_vs_1"] = round(many / one, 2) if one else float("nan")
    reports["job"] = REPLICA_JOB
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start an inline one on the tiny random-weight model)")
    parser.add_argument("--clients", type=int, default=None, help="default 10 (8 with --compare-replicas)")
    parser.add_argument("--jobs", type=int, default=None, help="default 40 (16 with --compare-replicas)")
    parser.add_argument("--max-queue", type=int, default=4, help="for the server this script starts")
    parser.add_argument("--api-key")
    parser.add_argument("--client", choices=("openai", "httpx"), default=default_client())
    parser.add_argument("--first-event", action="store_true", help="also time each job's first event")
    parser.add_argument(
        "--compare-replicas", action="store_true", help="2 mp ranks: --replicas 2 vs --replicas 1 (jobs/s, latencies)"
    )
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.compare_replicas:
        report = compare_replicas(args.clients or 8, args.jobs or 16, args.client)
        print(json.dumps(report, indent=2))
        return
    load = {"clients": args.clients or 10, "jobs": args.jobs or 40, "headers": headers, "client": args.client}
    if args.url:
        report = run_load(args.url, **load, first_event=args.first_event)
    else:
        with local_server(args.max_queue) as url:
            report = run_load(url, **load, first_event=args.first_event)
    report.pop("accepted_ids")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
