"""Input checks of the batch path and of image loading: an image too large to decode (a decompression bomb), batch
items that would share a video file, and item names that only become too long once `.mp4` is added; each refused
before any work, as its own failed item, while the other items go on."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from distvideo.batch.run import plan_batch, video_name
from distvideo.config import EngineConfig
from distvideo.errors import ConfigError
from distvideo.executors import resolve_engine
from distvideo.images import load_image
from distvideo.media import write_video
from distvideo.request import GenerationRequest

DEFAULTS = GenerationRequest(prompt="-", num_frames=5, height=32, width=48, num_inference_steps=2)


def png_claiming(path: Path, width: int, height: int) -> Path:
    """A PNG of a few bytes whose header claims `width` x `height` pixels (a decompression bomb's header)."""
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", width, height)  # IHDR: width, height, then its CRC over type + data
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    path.write_bytes(bytes(data))
    return path


@pytest.fixture(scope="module")
def model(tiny_model):
    return resolve_engine(EngineConfig(model=str(tiny_model))).model


# -- 1. decompression bombs ------------------------------------------------------------------------------------------


def test_an_image_over_pils_pixel_limit_is_a_config_error_naming_the_image(tmp_path):
    bomb = png_claiming(tmp_path / "bomb.png", 20000, 20000)  # 400M pixels: PIL raises DecompressionBombError
    with pytest.raises(ConfigError) as caught:
        load_image(bomb)
    message = str(caught.value)
    assert message.startswith("image:") and "bomb.png" in message and "too large" in message, message


def test_an_image_between_pils_limits_is_refused_too_not_decoded(tmp_path):
    """Between MAX_IMAGE_PIXELS and twice it PIL only warns (as it opens the file) and goes on decoding: refused the
    same way."""
    big = png_claiming(tmp_path / "big.png", 10000, 10000)  # 100M pixels: over 89.5M, under 179M
    with pytest.raises(ConfigError) as caught, pytest.warns(Image.DecompressionBombWarning):
        load_image(big)
    message = str(caught.value)
    assert message.startswith("image:") and "too large" in message and "100000000 pixels" in message, message


def test_a_batch_item_with_a_bomb_image_fails_alone(model, tmp_path):
    """The image is read when the item is resolved: a stand-in for an image-to-video model reads it as the real
    ones do (ModelInfo.resolve_request -> load_image), the rest is the tiny model's resolution."""
    bomb = png_claiming(tmp_path / "bomb.png", 20000, 20000)

    class ReadsImages:
        def resolve_request(self, request: GenerationRequest) -> GenerationRequest:
            pixels = load_image(request.image) if request.image is not None else None
            return dataclasses.replace(model.resolve_request(dataclasses.replace(request, image=None)), image=pixels)

    raw = [{"prompt": "fine"}, {"prompt": "bomb", "image": str(bomb)}, {"prompt": "also fine"}]
    plan = plan_batch(raw, ReadsImages(), folder=tmp_path / "out", defaults=DEFAULTS)  # type: ignore[arg-type]
    assert [i.index for i in plan.invalid] == [1]
    assert plan.items[1].error.startswith("image:") and "too large" in plan.items[1].error
    assert [i.index for i in plan.todo] == [0, 2]


# -- 2. two items, one video file ------------------------------------------------------------------------------------


def test_items_sharing_a_video_name_the_later_ones_fail_at_planning(model, tmp_path):
    raw = [
        {"prompt": "a", "output": "same"},
        {"prompt": "b", "output": "same.mp4"},  # the same file as item 0's once .mp4 is added
        {"prompt": "c", "output": "other"},
        {"prompt": "d", "output": "same"},
    ]
    plan = plan_batch(raw, model, folder=tmp_path / "out", defaults=DEFAULTS)
    assert [i.index for i in plan.todo] == [0, 2]
    assert [i.index for i in plan.invalid] == [1, 3]
    assert plan.items[1].error == "output 'same.mp4' is also item 0's", plan.items[1].error
    assert plan.items[3].error == "output 'same.mp4' is also item 0's", plan.items[3].error


def test_an_output_equal_to_another_items_automatic_name_fails(model, tmp_path):
    first = plan_batch([{"prompt": "x"}, {"prompt": "y"}], model, folder=tmp_path / "a", defaults=DEFAULTS)
    automatic = video_name(first.items[1])
    plan = plan_batch(
        [{"prompt": "x", "output": automatic}, {"prompt": "y"}], model, folder=tmp_path / "b", defaults=DEFAULTS
    )
    assert [i.index for i in plan.todo] == [0] and plan.items[1].error == f"output {automatic!r} is also item 0's"


def test_a_failed_item_does_not_hold_its_name(model, tmp_path):
    raw = [{"prompt": "bad", "output": "same", "height": 50}, {"prompt": "good", "output": "same"}]
    plan = plan_batch(raw, model, folder=tmp_path / "out", defaults=DEFAULTS)
    assert [i.index for i in plan.todo] == [1] and "height=50" in plan.items[0].error


def test_shared_names_end_to_end_one_video_each_and_a_rerun_settles(tmp_path, capsys, tiny_model):
    from distvideo.cli.main import main

    jsonl = tmp_path / "dup.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps(x) + "\n" for x in [{"prompt": "a", "output": "same"}, {"prompt": "b", "output": "same.mp4"}]
        )
    )
    out = tmp_path / "b1"
    argv = [
        "generate",
        "--model",
        str(tiny_model),
        "--executor",
        "inline",
        "--prompts",
        str(jsonl),
        "--output",
        str(out),
        "--num-frames",
        "5",
        "--height",
        "32",
        "--width",
        "48",
        "--steps",
        "2",
        "--no-progress",
    ]
    assert main(argv) == 1
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [(r["index"], r["status"]) for r in records] == [(1, "failed"), (0, "done")]
    assert records[0]["error"] == "output 'same.mp4' is also item 0's"
    stamp = (out / "same.mp4").stat().st_mtime_ns
    assert main(argv) == 1  # the rerun redoes nothing: item 0 is done, item 1 is refused again
    assert (out / "same.mp4").stat().st_mtime_ns == stamp
    assert "1 done (1 from earlier runs), 1 failed, of 2" in capsys.readouterr().out


# -- 3. names too long once .mp4 is added, and the staging name ------------------------------------------------------


def test_an_output_too_long_with_mp4_added_fails_at_planning(model, tmp_path):
    raw = [{"prompt": "long", "output": "b" * 252}, {"prompt": "fine", "output": "b" * 251}]  # 256 and 255 bytes
    plan = plan_batch(raw, model, folder=tmp_path / "out", defaults=DEFAULTS)
    assert [i.index for i in plan.invalid] == [0] and [i.index for i in plan.todo] == [1]
    error = plan.items[0].error
    assert error.startswith(f"output={'b' * 252!r}") and "256 bytes" in error and "255" in error, error


def test_a_batch_video_with_the_longest_legal_name_is_written(tmp_path):
    """The batch replaces its own files through a staging name: it must not be longer than the target's."""
    frames = np.zeros((1, 16, 16, 3), dtype=np.uint8)
    target = tmp_path / ("b" * 251 + ".mp4")  # 255 bytes, the most a name can have

    def encode(frames: np.ndarray, file: Any, fps: int) -> None:
        file.write(b"video")

    assert write_video(frames, target, encode=encode, replace=True) == target
    assert write_video(frames, target, encode=encode, replace=True) == target  # over the old one, in one rename
    assert [p.name for p in tmp_path.iterdir()] == [target.name] and target.read_bytes() == b"video"


def test_the_staging_name_is_fixed_and_left_behind_by_no_failure(tmp_path, monkeypatch):
    """Replacing goes through `.distvideo-<pid>-<hex>.partial` (its length does not grow with the target's); when the
    rename fails, the staging link is removed, not left beside the target."""
    import os

    frames = np.zeros((1, 16, 16, 3), dtype=np.uint8)
    staged: list[str] = []

    def failing_replace(src: Any, dst: Any) -> None:
        staged.append(Path(src).name)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="Input/output error"):
        write_video(frames, tmp_path / "clip.mp4", encode=lambda f, file, fps: file.write(b"v"), replace=True)
    assert len(staged) == 1 and re.fullmatch(rf"\.distvideo-{os.getpid()}-[0-9a-f]{{8}}\.partial", staged[0]), staged
    assert list(tmp_path.iterdir()) == []
