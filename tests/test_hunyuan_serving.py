"""HunyuanVideo 1.5 image-to-video through batch and serve: a JSONL batch over 2 mp replicas writes, for each item,
the video its single run writes (the same bytes: one rank per replica, the same layout), and a job served by
`distvideo serve` with an uploaded first frame gives the bytes of that item's single run too (inline, one rank)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from distvideo import VideoGenerator
from distvideo.batch import read_prompt_file

from background import FolderJob, in_a_process
from launchers import format_output
from serving_harness import start_server

pytestmark = pytest.mark.slow

COMMON = dict(num_frames=9, num_inference_steps=2)  # the guider's scale: guidance on, both branches
# One intra-op thread per rank on both sides: the replicas' default (cores / 2) and the served rank's (cores) differ,
# and byte identity holds at the same thread count (docs/determinism.md: on AVX-512, SigLIP's GELU of 729 x 32 values
# is split by thread count and rounds 1 level apart in 7 of the 82944 values).
ONE_THREAD = {"DISTVIDEO_NUM_THREADS": "1"}
# two images of other aspect ratios: each item's size is its image's bucket (48 x 64, then 64 x 48)
ITEMS = [
    {"prompt": 'a lighthouse with a sign reading "NORTH"', "seed": 5, "image": "wide.png"},
    {"prompt": "a boat on a calm lake", "seed": 6, "image": "tall.png"},
]


def batch_and_serve_to(folder: Path) -> None:
    """Everything the tests check, in a process of its own (OUTCOME), on the session's image-to-video checkpoint built
    here (the same bytes): each item's single run (replica 0), then the items as a JSONL batch, on one mp engine of 2
    replicas; then the first item served by `distvideo serve` (inline), its image uploaded. One thread per rank
    (ONE_THREAD) on both. Writes FOLDER/outcome.json beside the videos."""
    import os

    from distvideo.testing.families import write_test_image
    from distvideo.testing.hunyuan import build_hunyuan_checkpoint

    os.environ.update(ONE_THREAD)  # the workers take the driver's environment when they start
    model = build_hunyuan_checkpoint(folder / "hunyuan15-i2v", seed=22, image_to_video=True, target_size=64)
    images = {
        "wide.png": write_test_image(folder / "wide.png", width=40, height=28, seed=1),
        "tall.png": write_test_image(folder / "tall.png", width=28, height=40, seed=2),
    }
    items = [{**item, "image": str(images[item["image"]])} for item in ITEMS]
    jsonl = folder / "items.jsonl"
    jsonl.write_text("".join(json.dumps(item) + "\n" for item in items))
    single = []
    with VideoGenerator.from_pretrained(str(model), executor="mp", num_gpus=2, replicas=2) as gen:
        for index, item in enumerate(items):
            path = folder / f"single-{index}.mp4"
            fields = {k: v for k, v in item.items() if k != "prompt"}
            gen.generate(item["prompt"], output_path=str(path), **fields, **COMMON)
            single.append(str(path))
        results = gen.generate_batch(read_prompt_file(jsonl), output_dir=folder / "out", **COMMON)
    item = items[0]
    with start_server(folder / "serve", "inline", args=["--model", str(model)], env=ONE_THREAD) as server:
        fields = {"prompt": item["prompt"], "seed": str(item["seed"]), **{k: str(v) for k, v in COMMON.items()}}
        image = Path(item["image"])
        files = {"input_reference": (image.name, image.read_bytes(), "image/png")}
        response = server.http.post("/v1/videos", data=fields, files=files)
        video = server.wait(response.json()["id"]) if response.status_code == 200 else None
        content = server.http.get(f"/v1/videos/{video['id']}/content") if video is not None else None
    if content is not None:
        (folder / "served.mp4").write_bytes(content.content)
    outcome = {
        "single": single,
        "results": [
            {"index": r.index, "status": r.status, "error": r.error, "video_path": r.video_path} for r in results
        ],
        "manifest": [json.loads(line) for line in (folder / "out" / "manifest.jsonl").read_text().splitlines()],
        "created": [response.status_code, response.text],
        "served": video,
        "content_status": None if content is None else content.status_code,
    }
    (folder / "outcome.json").write_text(json.dumps(outcome))


# mp replicas and a server (about 17 s) whose outcome is all the tests check: in the background, in a process of its
# own (its server and workers at the job's nice 19; every wait in it is a deadline of 300 s)
OUTCOME = FolderJob(
    "HunyuanVideo 1.5 image-to-video: batch and serve",
    "hv15-serve",
    in_a_process("test_hunyuan_serving", "batch_and_serve_to"),
)
BACKGROUND_JOBS = {"outcome": OUTCOME.hooks}


@pytest.fixture(scope="module")
def outcome() -> dict[str, Any]:
    folder, proc = OUTCOME.result()
    assert proc.returncode == 0, format_output(proc)
    written = json.loads((folder / "outcome.json").read_text())
    return {**written, "folder": folder, "single": [Path(path).read_bytes() for path in written["single"]]}


def test_a_jsonl_batch_over_two_replicas_writes_each_items_single_run(outcome: dict[str, Any]) -> None:
    results = outcome["results"]
    assert [(r["index"], r["status"]) for r in results] == [(0, "done"), (1, "done")], [r["error"] for r in results]
    assert {record["replica"] for record in outcome["manifest"]} == {0, 1}, outcome["manifest"]
    assert outcome["single"][0] != outcome["single"][1]
    for result in results:
        assert Path(result["video_path"]).read_bytes() == outcome["single"][result["index"]], result["index"]


def test_a_served_image_to_video_job_is_the_single_runs_video(outcome: dict[str, Any]) -> None:
    status, text = outcome["created"]
    assert status == 200, text
    video = outcome["served"]
    assert video["status"] == "completed", video
    assert video["size"] == "64x48"  # width x height: the image's bucket
    assert outcome["content_status"] == 200
    assert (outcome["folder"] / "served.mp4").read_bytes() == outcome["single"][0]
