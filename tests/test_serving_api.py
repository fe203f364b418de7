"""`distvideo serve`, every endpoint, on a real server (loopback, a port it chose) under inline, mp (2 ranks) and
torchrun (2 ranks), with a real HTTP client: served videos are byte-identical to `generate` with the same arguments
(the encoder is deterministic), progress, cancel, the bounded queue, validation naming the field, a failed job with
the error gathered from every rank, list pagination, metrics, the API key and the body limit."""

from __future__ import annotations

import json
import signal

import pytest
import yaml

from distvideo import VideoGenerator

from serving_harness import SMALL, assert_stopped_cleanly, jobs_in_store, start_server

KEY = "serving-test-key-0123"
PROMPT = "a tiny boat on a lake"
LONG = {"size": "48x32", "num_frames": 5, "num_inference_steps": 400, "seed": 1}  # 20 s+ (SLOW_STEP_ENV): cancelled
PRESETS = {"seed": 7, "num_inference_steps": 1}  # --config's request section: for jobs that do not set them
EXECUTORS = [
    pytest.param("inline"),
    pytest.param("mp", marks=pytest.mark.slow),
    pytest.param("torchrun", marks=[pytest.mark.launcher, pytest.mark.slow]),
]


@pytest.fixture(scope="module", params=EXECUTORS)
def server(request, tmp_path_factory):
    from distvideo.models.embedded import tiny_model_path
    from distvideo.testing.lora_files import build_random_lora

    workdir = tmp_path_factory.mktemp(f"serve-{request.param}")
    style = build_random_lora(tiny_model_path(), workdir / "style.safetensors", seed=5)
    presets = workdir / "serve.yaml"
    presets.write_text(yaml.safe_dump({"request": PRESETS}))
    args = ["--max-queue", "2", "--max-body-bytes", "65536", "--lora-adapter", f"style={style}"]
    args += ["--config", str(presets), "--shutdown-grace", "1"]
    with start_server(workdir, request.param, args=args, api_key=KEY, fail_rank="all") as served:
        served.executor = request.param
        yield served
        stop_with_a_job_past_the_grace_period(served)


def stop_with_a_job_past_the_grace_period(server) -> None:
    """The server's last check, as it stops (no extra server per executor): SIGTERM while a job that needs 20 s or
    more runs; after --shutdown-grace 1 it is cancelled after its current step on every rank, and every rank exits 0."""
    video = server.create(prompt="outlasts the grace period", **LONG)
    server.wait_progress(video["id"])
    code = server.stop(signal.SIGTERM)
    log = server.log()
    assert_stopped_cleanly(server.executor, code, log)
    status, error_code, message = jobs_in_store(server.output)[video["id"]]
    assert (status, error_code) == ("failed", "server_shutdown"), (status, error_code, message, log)
    assert "grace period of 1 s" in message and "every rank stopped after step" in message, message
    assert not (server.output / f"{video['id']}.mp4").exists()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The MP4 bytes `generate` writes for the SMALL request, per world size (1: inline; 2: the mp layout, which
    torchrun's 2 ranks share)."""
    cache: dict[int, bytes] = {}
    folder = tmp_path_factory.mktemp("reference")

    def get(world_size: int) -> bytes:
        if world_size not in cache:
            kwargs = {"executor": "inline"} if world_size == 1 else {"executor": "mp", "num_gpus": world_size}
            width, height = (int(v) for v in SMALL["size"].split("x"))
            with VideoGenerator.from_pretrained(**kwargs) as gen:
                result = gen.generate(
                    PROMPT,
                    num_frames=SMALL["num_frames"],
                    height=height,
                    width=width,
                    num_inference_steps=SMALL["num_inference_steps"],
                    seed=SMALL["seed"],
                    output_path=str(folder / f"world{world_size}.mp4"),
                )
            cache[world_size] = open(result.video_path, "rb").read()
        return cache[world_size]

    return get


def world_size(server) -> int:
    return 1 if server.executor == "inline" else 2


def test_health_models_and_the_api_key(server):
    health = server.http.get("/health", headers={"Authorization": ""})
    assert health.status_code == 200, health.text  # /health needs no key: probes can reach it
    assert health.json() == {
        "status": "ok",
        "detail": None,
        "executor": ("external" if server.executor == "torchrun" else server.executor),
        "world_size": world_size(server),
    }
    models = server.http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-wan"]
    assert models["data"][0]["spatial_stride"] == 16 and models["data"][0]["image_input"] is False
    for path in ("/v1/models", "/v1/videos", "/metrics"):
        refused = server.http.get(path, headers={"Authorization": "Bearer wrong-key-123"})
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", path
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert server.http.get(path, headers={"Authorization": ""}).status_code == 401


def test_a_served_video_is_the_file_generate_writes(server, reference):
    video = server.create(prompt=PROMPT, **SMALL)
    assert video["status"] == "queued" and video["progress"] == 0 and video["object"] == "video"
    assert (video["size"], video["num_frames"], video["seconds"]) == ("48x32", 5, "0.25")
    done = server.wait(video["id"])
    assert done["status"] == "completed", done
    assert done["progress"] == 100 and done["completed_at"] >= done["created_at"] and done["error"] is None
    content = server.http.get(f"/v1/videos/{video['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    assert content.content == reference(world_size(server))
    assert (server.output / f"{video['id']}.mp4").read_bytes() == content.content  # named by the server
    part = server.http.get(f"/v1/videos/{video['id']}/content", headers={"Range": "bytes=10-109"})
    assert part.status_code == 206 and part.content == content.content[10:110]
    assert part.headers["content-range"] == f"bytes 10-109/{len(content.content)}"
    outside = server.http.get(f"/v1/videos/{video['id']}/content", headers={"Range": "bytes=99999999-"})
    assert outside.status_code == 416


def test_a_registered_lora_applies_to_its_job_only(server, reference):
    assert server.http.get("/v1/models").json()["data"][0]["lora_adapters"] == ["style"]
    styled = server.wait(server.create(prompt=PROMPT, lora={"name": "style", "strength": 0.8}, **SMALL)["id"])
    assert styled["status"] == "completed" and styled["lora"] == {"name": "style", "strength": 0.8}, styled
    styled_bytes = server.http.get(f"/v1/videos/{styled['id']}/content").content
    assert styled_bytes != reference(world_size(server))
    plain = server.wait(server.create(prompt=PROMPT, **SMALL)["id"])
    plain_bytes = server.http.get(f"/v1/videos/{plain['id']}/content").content
    assert plain_bytes == reference(world_size(server))  # the base weights are back, exactly, on every rank


def test_progress_then_delete_cancels_the_running_job(server):
    video = server.create(prompt="a long ride", **LONG)
    running = server.wait_progress(video["id"], at_least=1)
    assert running["status"] == "in_progress" and 1 <= running["progress"] <= 99, running
    not_yet = server.http.get(f"/v1/videos/{video['id']}/content")  # running: no file yet
    assert not_yet.status_code == 409 and not_yet.json()["error"]["code"] == "not_ready", not_yet.text
    response = server.http.delete(f"/v1/videos/{video['id']}")
    assert response.status_code == 202 and response.json()["id"] == video["id"]
    failed = server.wait(video["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "cancelled", failed
    assert "every rank stopped after step" in failed["error"]["message"]
    assert server.http.delete(f"/v1/videos/{video['id']}").json() == {
        "id": video["id"],
        "object": "video.deleted",
        "deleted": True,
    }
    assert server.http.get(f"/v1/videos/{video['id']}").status_code == 404


def test_a_full_queue_answers_429_and_a_queued_job_can_be_deleted(server):
    running = server.create(prompt="a long ride", **LONG)
    server.wait_progress(running["id"])
    queued = [server.create(prompt=f"queued {i}", **SMALL) for i in range(2)]  # --max-queue 2
    refused = server.http.post("/v1/videos", json={"prompt": "one too many", **SMALL})
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "queue_full"
    not_yet = server.http.get(f"/v1/videos/{queued[1]['id']}/content")  # queued: no file yet
    assert not_yet.status_code == 409 and not_yet.json()["error"]["code"] == "not_ready", not_yet.text
    assert server.http.delete(f"/v1/videos/{queued[0]['id']}").json()["deleted"] is True
    assert server.http.get(f"/v1/videos/{queued[0]['id']}").status_code == 404
    assert server.http.delete(f"/v1/videos/{running['id']}").status_code == 202
    assert server.wait(running["id"])["error"]["code"] == "cancelled"
    assert server.wait(queued[1]["id"])["status"] == "completed"  # the engine goes on after a cancel


def test_a_job_that_fails_on_the_ranks_is_recorded_with_their_errors_and_the_server_goes_on(server):
    failed = server.wait(server.create(prompt="please inject a fault", **SMALL)["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed", failed
    for rank in range(world_size(server)):
        assert f"rank {rank}: RuntimeError: injected fault on rank {rank}" in failed["error"]["message"]
    assert server.wait(server.create(prompt="after the failure", **SMALL)["id"])["status"] == "completed"
    assert server.http.get("/health").json()["status"] == "ok"


def test_the_list_is_newest_first_with_a_cursor(server):
    ids = [server.create(prompt=f"list {i}", **SMALL)["id"] for i in range(2)]
    first = server.http.get("/v1/videos", params={"limit": 1}).json()
    assert [v["id"] for v in first["data"]] == [ids[1]] and first["has_more"] is True
    assert first["first_id"] == first["last_id"] == ids[1]
    second = server.http.get("/v1/videos", params={"limit": 1, "after": first["last_id"]}).json()
    assert [v["id"] for v in second["data"]] == [ids[0]]
    oldest = server.http.get("/v1/videos", params={"order": "asc", "limit": 100}).json()["data"]
    assert [v["id"] for v in oldest][-2:] == ids
    unknown = server.http.get("/v1/videos", params={"after": "video_nope"})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "after"
    for job_id in ids:
        server.wait(job_id)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"prompt": "x", "size": "47x32"}, "size", "multiple of 16"),
        ({"prompt": "x", "num_frames": 6}, "num_frames", "4k+1"),
        ({"prompt": "x", "seconds": "0.3"}, "seconds", "whole number"),
        ({"prompt": "x", "seconds": 1, "num_frames": 5}, "num_frames", "give one"),
        ({"prompt": "x", "model": "another-model"}, "model", "not served here"),
        ({"prompt": "x", "quality": "high"}, "quality", "unknown field"),
        ({"size": "48x32"}, "prompt", "Field required"),
        ({"prompt": "   "}, "prompt", "non-empty"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "greater than or equal to 1"),
        ({"prompt": "x", "num_inference_steps": 901}, "num_inference_steps", "--max-steps=900"),
        ({"prompt": "x", "seed": "3"}, "seed", "valid integer"),
        ({"prompt": "x", "lora": {"name": "nope"}}, "lora", "not registered; registered: style"),
    ],
)
def test_bad_requests_are_refused_before_queueing_naming_the_field(server, body, param, needle):
    response = server.http.post("/v1/videos", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_bodies_the_api_does_not_take(server):
    bad_json = server.http.post("/v1/videos", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    text = server.http.post("/v1/videos", content=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert text.status_code == 415
    huge = server.http.post("/v1/videos", json={"prompt": "x" * 70000})  # --max-body-bytes 65536
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "too_large"
    image = server.http.post(
        "/v1/videos",
        data={"prompt": "a boat", "size": "48x32"},
        files={"input_reference": ("boat.png", b"\x89PNG\r\n\x1a\n", "image/png")},
    )
    assert image.status_code == 422 and image.json()["error"]["param"] == "input_reference", image.text
    fields = {"prompt": PROMPT, "num_frames": "5", "size": "48x32", "num_inference_steps": "1"}
    form = server.http.post("/v1/videos", files={k: (None, v) for k, v in fields.items()})  # multipart, no file
    assert form.status_code == 200, form.text  # multipart without an image is the JSON request as form fields
    assert server.wait(form.json()["id"])["status"] == "completed"


def test_deleting_a_finished_job_removes_its_file(server):
    video = server.wait(server.create(prompt="to be deleted", **SMALL)["id"])
    path = server.output / f"{video['id']}.mp4"
    assert path.is_file()
    assert server.http.delete(f"/v1/videos/{video['id']}").json()["deleted"] is True
    assert not path.exists()
    assert server.http.get(f"/v1/videos/{video['id']}/content").status_code == 404
    assert server.http.delete(f"/v1/videos/{video['id']}").status_code == 404


def metric_samples(server) -> dict[str, str]:
    response = server.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return dict(line.rsplit(" ", 1) for line in response.text.splitlines() if line and not line.startswith("#"))


def test_metrics_in_prometheus_text(server):
    """The counters rise by what this test did (other tests on this server counted before)."""
    counted = (
        "distvideo_jobs_submitted_total",
        *(f'distvideo_jobs_finished_total{{outcome="{outcome}"}}' for outcome in ("completed", "failed", "cancelled")),
        'distvideo_jobs_rejected_total{reason="invalid"}',
    )
    before = metric_samples(server)
    assert server.wait(server.create(prompt="for the metrics", **SMALL)["id"])["status"] == "completed"
    assert server.wait(server.create(prompt="please inject a fault", **SMALL)["id"])["status"] == "failed"
    assert server.http.post("/v1/videos", json={"prompt": "x", "size": "47x32"}).status_code == 422  # not admitted
    samples = metric_samples(server)
    assert samples["distvideo_queue_depth"] == "0" and samples["distvideo_up"] == "1"
    assert int(samples['distvideo_jobs{status="completed"}']) >= 1
    assert float(samples['distvideo_stage_seconds_sum{stage="denoising"}']) > 0
    assert {name: int(samples[name]) - int(before[name]) for name in counted} == {
        "distvideo_jobs_submitted_total": 2,
        'distvideo_jobs_finished_total{outcome="completed"}': 1,
        'distvideo_jobs_finished_total{outcome="failed"}': 1,
        'distvideo_jobs_finished_total{outcome="cancelled"}': 0,
        'distvideo_jobs_rejected_total{reason="invalid"}': 1,
    }


def test_the_config_file_presets_the_fields_a_request_leaves_unset(server):
    # a request's own values win over the presets: every SMALL job here sets seed 3 and steps 2, and its file is
    # compared byte for byte with generate's
    preset = server.create(prompt="preset", size="48x32", num_frames=5)
    assert (preset["seed"], preset["num_inference_steps"]) == (7, 1), preset
    assert server.wait(preset["id"])["status"] == "completed"


def test_the_openapi_schema_documents_what_the_server_answers(server):
    schema = server.http.get("/openapi.json").json()
    create = schema["paths"]["/v1/videos"]["post"]
    assert set(create["requestBody"]["content"]) == {"application/json", "multipart/form-data"}
    assert {"400", "401", "413", "415", "422", "429", "503"} <= set(create["responses"])
    assert "Retry-After" in create["responses"]["429"]["headers"]
    content = schema["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]
    assert {"200", "206", "404", "409", "416"} <= set(content)
    assert set(schema["components"]["schemas"]["VideoCreate"]["properties"]) >= {"prompt", "size", "seconds", "lora"}
    page = server.http.get("/")
    assert page.status_code == 200 and 'id="create"' in page.text
    json.dumps(schema)


def test_step_cache_options_are_refused_naming_the_field(server):
    """Step caching is chosen per request (docs/caching.md); bad choices are a 422 naming the field."""
    unknown = server.http.post("/v1/videos", json={"prompt": "x", "cache": "teacache"})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "cache", unknown.text
    uncalibrated = server.http.post("/v1/videos", json={"prompt": "x", "cache": "mag", "num_inference_steps": 3})
    assert uncalibrated.status_code == 422 and uncalibrated.json()["error"]["param"] == "cache", uncalibrated.text
    assert "distvideo calibrate" in uncalibrated.json()["error"]["message"]
    threshold = server.http.post("/v1/videos", json={"prompt": "x", "cache": "first-block", "cache_threshold": -1})
    assert threshold.status_code == 422, threshold.text
