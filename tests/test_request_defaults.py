"""One owner of every request default (issue 26, defect 2): `ModelInfo.resolve_request` fills fps, frames, size,
steps and guidance for `generate`, batch, `serve` and `bench` alike, so the same request gives the same file through
each. Wan2.2 TI2V-5B is the family whose frame rate (24) is not the GenerationRequest's old hard default (16): served
videos were written at 16 fps and `seconds` was converted at 16 fps, while `generate` wrote 24.
"""

from __future__ import annotations

import json
from pathlib import Path

import av
import pytest

from distvideo.cli.main import main
from family_checkpoints import family_checkpoint

from serving_harness import start_server

pytestmark = pytest.mark.slow

PROMPT = "a red fox running through snow"
# 25 frames = 1 s at TI2V-5B's 24 fps; no fps given anywhere: each entry point must take the model's
FLAGS = ["--num-frames", "25", "--height", "64", "--width", "96", "--steps", "2", "--seed", "3", "--no-progress"]


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory) -> Path:
    return family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")


@pytest.fixture(scope="module")
def generated(ti2v, tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("defaults-generate") / "fox.mp4"
    argv = ["generate", "--model", str(ti2v), "--prompt", PROMPT, *FLAGS, "--output", str(out), "--executor", "inline"]
    assert main(argv) == 0
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 24 and stream.frames == 25, "the family's frame rate, all 25 frames"
    return out.read_bytes()


def test_batch_writes_the_generate_file(ti2v, generated, tmp_path):
    prompts = tmp_path / "items.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "seed": 3}) + "\n")  # an item without one gets a derived seed
    argv = ["generate", "--model", str(ti2v), "--prompts", str(prompts), "--output", str(tmp_path / "out"), *FLAGS]
    assert main([*argv, "--executor", "inline"]) == 0
    [video] = (tmp_path / "out").glob("*.mp4")
    assert video.read_bytes() == generated


def test_serve_writes_the_generate_file_and_converts_seconds_at_the_model_rate(ti2v, generated, tmp_path):
    with start_server(tmp_path, "inline", args=["--model", str(ti2v)]) as served:
        job = served.create(prompt=PROMPT, size="96x64", seconds="1", num_inference_steps=2, seed=3)
        assert (job["fps"], job["num_frames"]) == (24, 25), job
        done = served.wait(job["id"])
        assert done["status"] == "completed", done
        content = served.http.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200, content.text
    assert content.content == generated


def test_bench_runs_the_generate_request(ti2v, tmp_path):
    report = tmp_path / "bench.json"
    argv = ["bench", "--model", str(ti2v), "--prompt", PROMPT, *FLAGS, "--runs", "1", "--warmup", "0"]
    assert main([*argv, "--executor", "inline", "--json", str(report)]) == 0
    config = json.loads(report.read_text())["config"]
    wanted = {"num_frames": 25, "height": 64, "width": 96, "steps": 2, "seed": 3, "fps": 24, "guidance_scale": 5.0}
    assert {k: config[k] for k in wanted} == wanted
