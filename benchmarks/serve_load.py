"""Load on `distvideo serve`: C concurrent clients submit J jobs in all, one at a time each: a client follows its job
to the end before submitting the next; a 429 is that job's answer (counted, not retried: the client waits Retry-After
before its next job). Every status call made while the client's job was generating is timed.

    .venv/bin/python benchmarks/serve_load.py                       # an inline server on the tiny random-weight model, port 0
    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 10 --jobs 40

Prints one JSON report: jobs accepted / refused with 429 / completed / failed / lost, duplicated ids, and the status
latency while generating (p50, p90, p99, max in ms). tests/test_serving_load.py runs the same function.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

JOB = {"prompt": "a lantern on a quiet river", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def run_load(
    url: str,
    *,
    clients: int = 10,
    jobs: int = 40,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    poll_s: float = 0.1,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    body = dict(body or JOB)
    lock = threading.Lock()
    next_job = iter(range(jobs))
    accepted: list[str] = []
    refused: list[int] = []
    errors: list[str] = []
    final: dict[str, str] = {}
    latencies_ms: list[float] = []
    deadline = time.monotonic() + timeout_s

    def client() -> None:
        with httpx.Client(base_url=url, headers=headers or {}, timeout=120.0) as http:
            while True:
                with lock:
                    index = next(next_job, None)
                if index is None:
                    return
                response = http.post("/v1/videos", json={**body, "seed": index})
                if response.status_code == 429:  # that job's answer; the client waits as told before its next one
                    with lock:
                        refused.append(index)
                    time.sleep(min(float(response.headers.get("retry-after", 1)), 30.0))
                    continue
                if response.status_code != 200:
                    with lock:
                        errors.append(f"job {index}: POST {response.status_code} {response.text[:200]}")
                    continue
                job_id = response.json()["id"]
                with lock:
                    accepted.append(job_id)
                while time.monotonic() < deadline:
                    start = time.perf_counter()
                    video = http.get(f"/v1/videos/{job_id}").json()
                    elapsed_ms = (time.perf_counter() - start) * 1000
                    if video["status"] == "in_progress":
                        with lock:
                            latencies_ms.append(elapsed_ms)
                    if video["status"] in ("completed", "failed"):
                        with lock:
                            final[job_id] = video["status"]
                        break
                    time.sleep(poll_s)

    started = time.monotonic()
    threads = [threading.Thread(target=client, name=f"client-{i}") for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    statuses = list(final.values())
    return {
        "clients": clients,
        "jobs_submitted": jobs,
        "accepted": len(accepted),
        "refused_429": len(refused),
        "completed": statuses.count("completed"),
        "failed": statuses.count("failed"),
        "lost": len(set(accepted) - set(final)),
        "duplicated_ids": len(accepted) - len(set(accepted)),
        "errors": errors,
        "accepted_ids": accepted,
        "wall_s": round(wall, 2),
        "status_latency_while_generating_ms": {
            "samples": len(latencies_ms),
            "p50": round(_percentile(latencies_ms, 0.50), 2),
            "p90": round(_percentile(latencies_ms, 0.90), 2),
            "p99": round(_percentile(latencies_ms, 0.99), 2),
            "max": round(max(latencies_ms, default=float("nan")), 2),
        },
    }


@contextmanager
def local_server(max_queue: int) -> Iterator[str]:
    """An inline `distvideo serve` on the tiny random-weight model, on a port it chooses; yields its URL."""
    from distvideo.models.embedded import tiny_model_path

    distvideo = Path(sys.executable).parent / "distvideo"
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        cmd = [str(distvideo), "serve", "--executor", "inline", "--port", "0", "--output", folder, "--no-progress"]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start an inline one on the tiny random-weight model)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--max-queue", type=int, default=4, help="for the server this script starts")
    parser.add_argument("--api-key")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.url:
        report = run_load(args.url, clients=args.clients, jobs=args.jobs, headers=headers)
    else:
        with local_server(args.max_queue) as url:
            report = run_load(url, clients=args.clients, jobs=args.jobs, headers=headers)
    report.pop("accepted_ids")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
