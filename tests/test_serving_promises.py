"""Promises of docs/serving.md that need no server process of their own: an image-to-video job served from this
process (the engine loop in a thread, as `distvideo serve` runs it), the warning when the server listens beyond
loopback without an API key, and the config-file fields a server refuses to preset. The signal and metrics promises
are checked on the servers test_serving_api.py and test_serving_lifecycle.py start anyway."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from distvideo import EngineConfig, VideoGenerator
from distvideo.cli.main import main
from distvideo.executors import resolve_engine
from distvideo.serving.adapters import Adapters
from distvideo.serving.options import ServeOptions
from distvideo.serving.runner import EngineLoop
from distvideo.serving.server import Frontend
from family_checkpoints import family_checkpoint, test_image

PROMPT = "a red kite over a beach"
I2V_FIELDS = {"prompt": PROMPT, "size": "32x32", "num_frames": "5", "num_inference_steps": "2", "seed": "3"}


@contextlib.contextmanager
def served_here(config: EngineConfig, output: Path) -> Iterator[tuple[httpx.Client, VideoGenerator]]:
    """`distvideo serve`'s rank 0 in this process: the HTTP server, and the engine loop in a thread."""
    engine = resolve_engine(config)
    options = ServeOptions(port=0, output=str(output))
    front = Frontend(engine, options, {})
    front.start_http(engine, options)
    assert front.http is not None
    gen = VideoGenerator.from_engine(engine)
    try:
        loop = front.loop = EngineLoop(gen, front.service, front.store, Adapters(gen, [], {}))
        front.service.set_ready()
        thread = threading.Thread(target=loop.run, daemon=True)
        thread.start()
        with httpx.Client(base_url=front.http.url, timeout=60) as client:
            yield client, gen
    finally:
        front.service.close("stopping", "the test ended")  # the loop returns while it waits for a job
        gen.shutdown()
        front.close()


def wait_done(client: httpx.Client, video_id: str, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while (video := client.get(f"/v1/videos/{video_id}").json())["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{video_id} still {video['status']} after {timeout:g} s"
        time.sleep(0.05)
    return video


@pytest.mark.slow
def test_an_image_to_video_job_is_accepted_and_conditioned_on_its_input_reference(tmp_path_factory, tmp_path):
    model = family_checkpoint(tmp_path_factory, "wan21_i2v")  # takes an image, requires one
    images = [test_image(tmp_path_factory, seed=seed) for seed in (0, 1)]
    with served_here(EngineConfig(model=str(model), executor="inline"), tmp_path / "out") as (client, gen):
        contents = []
        for image in images:
            upload = {"input_reference": ("first-frame.png", image.read_bytes(), "image/png")}
            response = client.post("/v1/videos", data=I2V_FIELDS, files=upload)
            assert response.status_code == 200, response.text
            done = wait_done(client, response.json()["id"])
            assert done["status"] == "completed", done
            contents.append(client.get(f"/v1/videos/{done['id']}/content").content)
        garbage = {"input_reference": ("first-frame.png", b"not an image", "image/png")}
        refused = client.post("/v1/videos", data=I2V_FIELDS, files=garbage)
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "input_reference", refused.text
        reference = gen.generate(
            PROMPT, image=str(images[0]), num_frames=5, height=32, width=32, num_inference_steps=2, seed=3,
            output_path=str(tmp_path / "reference.mp4"),
        )  # fmt: skip
    assert contents[0] == Path(reference.video_path).read_bytes()  # the file `generate --image` writes
    assert contents[1] != contents[0]  # another first frame, another video


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize(
    ("host", "api_key", "warns"),
    [("0.0.0.0", None, True), ("127.0.0.1", None, False), ("localhost", None, False), ("0.0.0.0", "k" * 16, False)],
)
def test_listening_beyond_loopback_without_an_api_key_warns(tmp_path, host, api_key, warns):
    engine = resolve_engine(EngineConfig(executor="inline"))  # reads the model's JSON files; loads no weights
    records = _Records()
    serving_logger = logging.getLogger("distvideo.serving")
    serving_logger.addHandler(records)  # its own handler: `distvideo` may not propagate to the root logger
    try:
        front = Frontend(engine, ServeOptions(host=host, port=0, output=str(tmp_path), api_key=api_key), {})
        front.close()
    finally:
        serving_logger.removeHandler(records)
    warning = f"listening on {host} without an API key: anyone who reaches this port can submit jobs"
    assert (warning in records.messages) == warns, records.messages


@pytest.mark.parametrize("field", ["prompt", "output_path"])
def test_a_config_file_may_not_preset_a_prompt_or_an_output_path_for_a_server(tmp_path, capsys, field):
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"request": {field: "x.mp4", "seed": 7}}))
    # --port 99999 is refused too, after the config file: a server that took the preset would fail on it instead
    assert main(["serve", "--config", str(config), "--port", "99999"]) == 2
    err = capsys.readouterr().err
    assert f"'request.{field}' cannot be preset for a server" in err and "presettable: negative_prompt" in err, err
