"""Bad input to `distvideo serve` and to POST /v1/videos is refused naming the flag or field, before anything is
created or queued: the flags through a real `distvideo serve` process (each refusal comes before the model loads), the
request bodies through the app itself (FastAPI's TestClient; no engine, no model weights)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sqlite3
import struct
import zlib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from distvideo.cli.main import main
from distvideo.errors import ConfigError
from distvideo.families.wan import WAN22_TI2V_5B
from distvideo.models.registry import probe_model
from distvideo.serving.admission import Admission
from distvideo.serving.app import AppContext, create_app
from distvideo.serving.events import JobEvents
from distvideo.serving.jobs import Service
from distvideo.serving.options import ServeLimits
from distvideo.serving.store import STORE_NAME, JobStore

TINY = Path(__file__).resolve().parents[1] / "src" / "distvideo" / "assets" / "tiny-wan"


# -- flags: `distvideo serve` exits 2 naming the flag, and leaves nothing behind ------------------------------------
@dataclasses.dataclass
class Served:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def serve(tmp_path, monkeypatch, capsys, no_weights_loaded):
    """`distvideo serve` in this process (its exit code and output): each case must end before the model loads (the
    tripwire fails it otherwise), so a regression fails the test instead of serving."""
    monkeypatch.chdir(tmp_path)

    def run(*flags: str) -> Served:
        code = main(["serve", "--model", str(TINY), "--executor", "inline", *flags])
        out = capsys.readouterr()
        return Served(code, out.out, out.err)

    return run


@pytest.mark.parametrize(
    ("host", "port_taken"),
    [("10.254.254.254", False), ("no-such-host.invalid", False), ("127.0.0.1", True)],
    ids=["address-not-here", "unresolvable", "port-in-use"],
)
def test_a_host_or_port_it_cannot_listen_on_exits_2_before_the_output_folder_is_made(tmp_path, serve, host, port_taken):
    with socket.socket() as taken:
        port = "0"
        if port_taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = str(taken.getsockname()[1])
        done = serve("--host", host, "--port", port, "--output", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    assert "--host" in done.stderr and "--port" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("output", ["a-file", "a-file/videos", "x" * 300], ids=["a-file", "under-a-file", "too-long"])
def test_an_output_that_is_a_file_under_a_file_or_too_long_exits_2_naming_output(tmp_path, serve, output):
    (tmp_path / "a-file").write_text("x")
    done = serve("--port", "0", "--output", str(tmp_path / output))
    assert done.returncode == 2, done.stderr
    assert "--output" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and (tmp_path / "a-file").read_text() == "x"


def test_a_missing_lora_adapter_file_exits_2_before_anything_is_created(tmp_path, serve):
    missing = tmp_path / "nonexistent.safetensors"
    done = serve("--port", "0", "--output", str(tmp_path / "out"), "--lora-adapter", f"style={missing}")
    assert done.returncode == 2, done.stderr
    assert "--lora-adapter" in done.stderr and "style" in done.stderr, done.stderr
    assert "listening" not in done.stdout
    assert not (tmp_path / "out").exists()


# -- request bodies: 4xx naming the field, nothing queued, no file left ----------------------------------------------
@pytest.fixture
def app(tmp_path):
    """The HTTP app over a real store and queue, serving tiny-wan's metadata (no engine: nothing runs the jobs)."""

    def build(
        *, takes_image: bool = False, max_prompt_chars: int = 4000, model_dir: Path = TINY
    ) -> tuple[TestClient, Service, Path]:
        model = probe_model(model_dir)
        if takes_image:  # tiny-wan's metadata, as the family that takes an optional first frame
            model = dataclasses.replace(model, family=WAN22_TI2V_5B)
        output = tmp_path / "out"
        output.mkdir(exist_ok=True)
        service = Service(max_queue=8)
        service.set_ready()
        store = JobStore(output / STORE_NAME)
        admission = Admission(
            model=model,
            model_id=model_dir.name,
            limits=ServeLimits(max_prompt_chars=max_prompt_chars),
            output=output,
        )
        ctx = AppContext(
            service=service,
            store=store,
            admission=admission,
            cancel_running=lambda job_id: False,
            executor="inline",
            world_size=1,
            events=JobEvents(),
        )
        # an unexpected error is answered 500, as uvicorn answers it, instead of raised into the test
        return TestClient(create_app(ctx), raise_server_exceptions=False), service, output

    return build


GOOD = {"prompt": "a boat", "size": "48x32", "num_inference_steps": 2}


@pytest.mark.parametrize(
    "seconds",
    [5000, "5000", 0, "0", "0.000", -1, "9999", 1e308, "abc", True, [1]],
)
def test_bad_seconds_are_refused_naming_seconds_in_either_form(app, seconds):
    client, service, _ = app()
    response = client.post("/v1/videos", json={**GOOD, "seconds": seconds})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "seconds", error
    assert error["message"].startswith("seconds"), error
    assert "string" not in error["message"] or isinstance(seconds, (bool, list)), error
    assert service.depth == 0


@pytest.mark.parametrize("seconds", [1, "1", 1.0, "1.0", "0.25"])
def test_good_seconds_are_taken_as_a_number_or_text(app, seconds):
    client, _, _ = app()
    response = client.post("/v1/videos", json={**GOOD, "seconds": seconds})
    assert response.status_code == 200, response.text
    assert response.json()["seconds"] == f"{float(seconds):g}"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"scheduler": "ddim"}, "scheduler"),
        ({"timesteps": [500, 1000]}, "timesteps"),
        ({"timesteps": [1000, 500, 250]}, "timesteps"),  # 3 values for num_inference_steps 2
        ({"sigmas": [1.0], "timesteps": [1000]}, "sigmas"),
        ({"flow_shift": 0}, "flow_shift"),
    ],
    ids=["scheduler", "increasing", "length", "both", "shift"],
)
def test_a_bad_schedule_is_refused_naming_the_field(app, fields, param):
    client, service, _ = app()
    response = client.post("/v1/videos", json={**GOOD, **fields})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert service.depth == 0
    good = client.post("/v1/videos", json={**GOOD, "scheduler": "euler", "flow_shift": 5, "timesteps": [1000, 500]})
    assert good.status_code == 200, good.text


def test_seconds_that_are_not_a_whole_number_of_frames_are_still_refused(app):
    client, _, _ = app()
    response = client.post("/v1/videos", json={**GOOD, "seconds": "0.3"})
    assert response.status_code == 422 and "whole number" in response.json()["error"]["message"], response.text


def test_seconds_in_a_form_is_checked_as_the_json_field(app):
    client, _, _ = app()
    fields = {**{k: str(v) for k, v in GOOD.items()}, "seconds": "0"}
    response = client.post("/v1/videos", files={k: (None, v) for k, v in fields.items()})
    assert response.status_code == 422 and response.json()["error"]["param"] == "seconds", response.text


def test_the_openapi_schema_says_seconds_is_a_positive_duration_as_number_or_text(app):
    client, _, _ = app()
    schema = client.get("/openapi.json").json()["components"]["schemas"]["VideoCreate"]["properties"]["seconds"]
    kinds = {branch.get("type"): branch for branch in schema["anyOf"]}
    assert set(kinds) == {"string", "number", "null"}, schema
    assert kinds["number"]["exclusiveMinimum"] == 0 and kinds["number"]["maximum"] == 3600, schema
    assert "pattern" in kinds["string"], schema


def test_a_long_negative_prompt_is_refused_as_the_prompt_is(app):
    client, _, _ = app(max_prompt_chars=100)
    response = client.post("/v1/videos", json={**GOOD, "negative_prompt": "n" * 101})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "negative_prompt" and "100" in error["message"], error
    fits = client.post("/v1/videos", json={**GOOD, "negative_prompt": "n" * 100})
    assert fits.status_code == 200, fits.text


def bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A tiny PNG whose header claims width x height pixels (PIL refuses it as a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def post_image(client: TestClient, image: bytes) -> object:
    fields = {k: str(v) for k, v in GOOD.items()}
    return client.post("/v1/videos", data=fields, files={"input_reference": ("bomb.png", image, "image/png")})


def test_an_upload_is_removed_whatever_fails_before_its_job_is_queued(app, monkeypatch):
    client, service, output = app(takes_image=True)

    def fails(self, body, job_id, image_path=None):
        assert image_path is not None and Path(image_path).is_file()  # the upload was written
        raise RuntimeError("an unexpected failure while admitting")

    monkeypatch.setattr(Admission, "admit", fails)
    response = post_image(client, bomb_png(64, 64))
    assert response.status_code == 500, response.text
    assert not list(output.glob("*.input")), list(output.iterdir())
    assert service.depth == 0


def test_an_oversized_image_is_a_4xx_naming_input_reference(app):
    client, _, output = app(takes_image=True)
    response = post_image(client, bomb_png())
    assert 400 <= response.status_code < 500, response.text  # needs distvideo.images to refuse it as a ConfigError
    assert response.json()["error"]["param"] == "input_reference", response.text
    assert str(output) not in response.text, "the error shows the client a path of the server"
    assert not list(output.glob("*.input"))


def test_an_image_the_loader_refuses_is_a_422_naming_input_reference(app, monkeypatch):
    client, _, output = app(takes_image=True)

    def refuses(self, body, job_id, image_path=None):
        raise ConfigError(f"image: {image_path!r} is too large to read")

    monkeypatch.setattr(Admission, "admit", refuses)
    response = post_image(client, bomb_png(64, 64))
    assert response.status_code == 422 and response.json()["error"]["param"] == "input_reference", response.text
    assert response.json()["error"]["message"] == "image: the uploaded file is too large to read", response.text
    assert not list(output.glob("*.input"))


@pytest.mark.parametrize("store", ["not-sqlite", "another-programs-videos-table"])
def test_an_output_holding_a_file_that_is_no_job_store_exits_2_naming_output(tmp_path, serve, store):
    """Before, a raw sqlite3 error (exit 1) that named neither the flag nor the file, with the folder's lock and the
    socket left open in the process: the second attempt here would find the lock taken."""
    out = tmp_path / "out"
    out.mkdir()
    if store == "not-sqlite":
        (out / STORE_NAME).write_bytes(b"not a database " * 100)
    else:
        with contextlib.closing(sqlite3.connect(out / STORE_NAME)) as db:
            db.executescript("CREATE TABLE videos (name TEXT); INSERT INTO videos VALUES ('mine');")
    for _ in range(2):
        done = serve("--port", "0", "--output", str(out))
        assert done.returncode == 2, done.stderr
        assert f"--output {out}: its {STORE_NAME} is not a job store this server can use" in done.stderr, done.stderr


def test_a_prompt_the_demo_model_cannot_draw_is_warned_about_in_the_response(app):
    """The demo model knows only its grammar: the job's object says so, naming it; a caption of it gets no warning."""
    from distvideo.models.embedded import DEMO_EXAMPLE_PROMPT, DEMO_MODEL_DIR

    client, _, _ = app(model_dir=DEMO_MODEL_DIR)
    fox = client.post("/v1/videos", json={"prompt": "a red fox running through snow", "num_inference_steps": 2})
    assert fox.status_code == 200, fox.text
    (warning,) = fox.json()["warnings"]
    assert "the demo model knows only captions of its grammar" in warning and "{ball|square|triangle}" in warning
    assert client.get(f"/v1/videos/{fox.json()['id']}").json()["warnings"] == [warning]  # kept with the job
    ball = client.post("/v1/videos", json={"prompt": DEMO_EXAMPLE_PROMPT, "num_inference_steps": 2})
    assert ball.status_code == 200 and ball.json()["warnings"] == [], ball.text
