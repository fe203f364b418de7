"""`GET /v1/videos/{id}/events` on a real server (inline): server-sent events of a job, from queued to completed or
failed, the same history replayed to a stream that starts late, a 404
for an unknown id before any stream starts, and the key check of the other routes."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from serving_harness import HELD, SMALL, Served, start_server

KEY = "events-key"


def read_events(server: Served, video_id: str, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Every event of the stream until the server ends it (after completed or failed)."""
    events = []
    with server.http.stream("GET", f"/v1/videos/{video_id}/events", timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
    return events


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with start_server(tmp_path_factory.mktemp("events"), "inline", api_key=KEY, hold=True, fail_rank="all") as served:
        yield served


def test_a_job_streams_queued_started_every_step_and_completed(server):
    running = server.create(prompt="hold the engine", **HELD)  # waits after its first step until released
    server.wait_progress(running["id"])
    queued = server.create(prompt="a red ball", **{**SMALL, "num_inference_steps": 3})
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: seen.extend(read_events(server, queued["id"])))
    reader.start()
    server.release()
    reader.join(timeout=300)
    assert not reader.is_alive()
    kinds = [e["type"] for e in seen]
    assert kinds == ["queued", "started", "progress", "progress", "progress", "completed"], seen
    assert [(e["step"], e["steps"]) for e in seen if e["type"] == "progress"] == [(1, 3), (2, 3), (3, 3)]
    assert {e["video_id"] for e in seen} == {queued["id"]}
    assert seen[-1]["progress"] == 100 and server.get(queued["id"])["status"] == "completed"
    # a stream that starts after the end replays the same history and ends
    assert read_events(server, queued["id"]) == seen
    assert server.wait(running["id"])["status"] == "completed"


def test_a_failed_job_ends_its_stream_with_the_error(server):
    job = server.create(prompt="please inject a fault", **SMALL)
    events = read_events(server, job["id"])
    assert [e["type"] for e in events][-1] == "failed", events
    assert events[-1]["error"]["code"] == "generation_failed"
    assert "injected fault" in events[-1]["error"]["message"]


def test_unknown_ids_and_missing_keys_are_refused_before_any_stream(server):
    missing = server.http.get("/v1/videos/video_nope/events")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "video_id", missing.text
    anonymous = httpx.get(f"{server.url}/v1/videos/video_nope/events", timeout=30)
    assert anonymous.status_code == 401, anonymous.text


def test_the_schema_documents_the_stream(server):
    schema = server.http.get("/openapi.json").json()
    route = schema["paths"]["/v1/videos/{video_id}/events"]["get"]
    assert "text/event-stream" in route["responses"]["200"]["content"], route
    assert "VideoEvent" in json.dumps(schema["components"]["schemas"])
