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
from test_hunyuan_i2v import hunyuan_i2v_checkpoint

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


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hunyuan_i2v_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each item's single run (replica 0), then the items as a JSONL batch, on one mp engine of 2 replicas (one
    thread per rank: ONE_THREAD)."""
    from distvideo.testing.families import write_test_image

    folder = tmp_path_factory.mktemp("hv15-batch")
    images = {
        "wide.png": write_test_image(folder / "wide.png", width=40, height=28, seed=1),
        "tall.png": write_test_image(folder / "tall.png", width=28, height=40, seed=2),
    }
    items = [{**item, "image": str(images[item["image"]])} for item in ITEMS]
    jsonl = folder / "items.jsonl"
    jsonl.write_text("".join(json.dumps(item) + "\n" for item in items))
    single = {}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ONE_THREAD.items():
            patch.setenv(name, value)  # the workers take the driver's environment when they start
        gen = VideoGenerator.from_pretrained(str(model), executor="mp", num_gpus=2, replicas=2)
    with gen:
        for index, item in enumerate(items):
            path = folder / f"single-{index}.mp4"
            fields = {k: v for k, v in item.items() if k != "prompt"}
            gen.generate(item["prompt"], output_path=str(path), **fields, **COMMON)
            single[index] = path.read_bytes()
        results = gen.generate_batch(read_prompt_file(jsonl), output_dir=folder / "out", **COMMON)
    manifest = [json.loads(line) for line in (folder / "out" / "manifest.jsonl").read_text().splitlines()]
    return {"items": items, "single": single, "results": results, "manifest": manifest}


def test_a_jsonl_batch_over_two_replicas_writes_each_items_single_run(runs: dict[str, Any]) -> None:
    results = runs["results"]
    assert [(r.index, r.status) for r in results] == [(0, "done"), (1, "done")], [r.error for r in results]
    assert {record["replica"] for record in runs["manifest"]} == {0, 1}, runs["manifest"]
    assert runs["single"][0] != runs["single"][1]
    for result in results:
        assert Path(result.video_path).read_bytes() == runs["single"][result.index], result.index


def test_a_served_image_to_video_job_is_the_single_runs_video(
    model: Path, runs: dict[str, Any], tmp_path: Path
) -> None:
    item = runs["items"][0]
    with start_server(tmp_path, "inline", args=["--model", str(model)], env=ONE_THREAD) as server:
        fields = {"prompt": item["prompt"], "seed": str(item["seed"]), **{k: str(v) for k, v in COMMON.items()}}
        image = Path(item["image"])
        response = server.http.post(
            "/v1/videos",
            data=fields,
            files={"input_reference": (image.name, image.read_bytes(), "image/png")},
        )
        assert response.status_code == 200, response.text
        video = server.wait(response.json()["id"])
        assert video["status"] == "completed", video
        assert video["size"] == "64x48"  # width x height: the image's bucket
        content = server.http.get(f"/v1/videos/{video['id']}/content")
    assert content.status_code == 200
    assert content.content == runs["single"][0]
