"""Promises of the CLI, media.py and envs.py with no other test: `generate` refuses an output folder it cannot write
and encoder settings the encoder rejects with exit 2 before loading the model (docs/reliability.md, "a bad output
path"); a user's MKL_CBWR is kept and the reproducible default applies when it is unset (docs/env_vars.md,
docs/determinism.md); grey and RGBA conditioning images are converted as images.load_image says (grey expanded to
RGB, alpha dropped; docs/families.md).

The image-at-its-own-path-on-each-rank promise is checked in the torchrun launch of tests/test_families_parallel.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import distvideo.media
from distvideo import GenerationRequest, VideoGenerator
from distvideo.cli.main import main
from family_checkpoints import family_checkpoint, max_abs_diff

SMALL_FLAGS = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "1", "--no-progress"]


def generate_cli(output: str) -> int:
    return main(["generate", "--prompt", "a fox", "--executor", "inline", "--output", output, *SMALL_FLAGS])


# --- an output folder that cannot be written -------------------------------------------------------------------------
@contextlib.contextmanager
def read_only_mount(backing: Path, mount: Path) -> Iterator[Path]:
    """`backing` seen read-only at `mount` (bindfs -r): unwritable for root too, whose permission bits mean nothing to
    the kernel (the tests run as root). Needs bindfs and /dev/fuse (make system-deps)."""
    if shutil.which("bindfs") is None:
        pytest.fail("bindfs is not installed: apt-get install -y bindfs (or: make system-deps)", pytrace=False)
    mount.mkdir()
    proc = subprocess.run(["bindfs", "-r", str(backing), str(mount)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"bindfs could not mount (needs root and /dev/fuse): {proc.stderr}"
    try:
        with pytest.raises(OSError, match="Read-only file system"):
            (mount / "probe").write_bytes(b"")
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=60)


@pytest.fixture
def read_only_dir(tmp_path):
    """An empty read-only folder (read_only_mount) that must still be empty at the end."""
    backing = tmp_path / "backing"
    backing.mkdir()
    with read_only_mount(backing, tmp_path / "read-only") as mount:
        yield mount
    assert list(backing.iterdir()) == [], "nothing is half-written"


@pytest.mark.fuse
@pytest.mark.parametrize(
    ("output", "expected"),
    [
        pytest.param("v.mp4", "the folder is not writable", id="file-in-it"),
        pytest.param("", "the folder is not writable", id="the-folder"),
        pytest.param("new/sub/v.mp4", "where its folder would be created, is not writable", id="folder-to-create"),
    ],
)
def test_an_unwritable_output_folder_exits_2_before_loading(read_only_dir, no_weights_loaded, capsys, output, expected):
    assert generate_cli(str(read_only_dir / output)) == 2
    err = capsys.readouterr().err
    assert expected in err and str(read_only_dir) in err, err


@pytest.mark.fuse
def test_bench_refuses_an_unwritable_json_file_before_loading(read_only_dir, no_weights_loaded, capsys):
    """Before, the benchmark ran to its end and only writing the report failed (exit 1)."""
    argv = ["bench", "--executor", "inline", "--runs", "1", "--warmup", "0", *SMALL_FLAGS]
    assert main([*argv, "--json", str(read_only_dir / "b.json")]) == 2
    err = capsys.readouterr().err
    assert f"--json '{read_only_dir / 'b.json'}': the folder is not writable" in err, err


@pytest.mark.fuse
def test_calibrate_refuses_a_model_folder_it_cannot_write_before_loading(
    tmp_path, tiny_model, no_weights_loaded, capsys
):
    """calibrate stores its ratios beside the model: a read-only model folder is refused before the calibration run
    (before, the run finished and only writing the file failed, exit 1)."""
    backing = tmp_path / "model"
    shutil.copytree(tiny_model, backing)
    with read_only_mount(backing, tmp_path / "read-only-model") as model:
        assert main(["calibrate", "--model", str(model), "--executor", "inline", "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "calibrate: the model folder's ratios file" in err and "the folder is not writable" in err, err


# --- encoder settings -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "value"), [("preset", "no-such-preset"), ("crf", "not-a-number"), ("profile", "baseline444")]
)
def test_settings_the_encoder_rejects_exit_2_before_loading(
    tmp_path, no_weights_loaded, monkeypatch, capsys, option, value
):
    """Every setting a user can give (width, height, fps) within its bounds is one x264 takes, so the writer's own
    options stand in for a setting it rejects: the check before loading opens the encoder as the writer will."""
    monkeypatch.setitem(distvideo.media.X264_OPTIONS, option, value)
    assert generate_cli(str(tmp_path / "out" / "v.mp4")) == 2
    err = capsys.readouterr().err
    assert "the video encoder refuses 48x32 at fps=16" in err and value in err, err
    assert list(tmp_path.iterdir()) == [], "nothing is written, no folder created"


# --- MKL_CBWR --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("user", "expected"), [("COMPATIBLE", "COMPATIBLE"), (None, "AUTO,STRICT")])
def test_a_user_set_mkl_cbwr_is_kept(user, expected):
    """Importing distvideo leaves the user's MKL_CBWR alone and sets the reproducible mode when it is unset; in a
    fresh process, since the mode is set at import (MKL reads the variable once)."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if user is not None:
        env["MKL_CBWR"] = user
    code = "import os, distvideo; print(os.environ.get('MKL_CBWR'))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected, proc.stdout


# --- grey and RGBA conditioning images --------------------------------------------------------------------------------
# one frame, one step, no CFG: the cheapest request whose frames still come from the image (TI2V conditions frame 0)
IMAGE_REQUEST = dict(num_frames=1, height=32, width=32, num_inference_steps=1, guidance_scale=1.0, seed=5)


@pytest.fixture(scope="module")
def images() -> dict[str, np.ndarray]:
    """A smooth grey image, and an RGBA one whose alpha varies (compositing it would give other pixels)."""
    rng = np.random.default_rng(3)
    ys, xs = np.mgrid[0:28, 0:40]
    grey = (127 + 100 * np.sin(xs / 5.0) * np.cos(ys / 7.0)).astype(np.uint8)
    rgb = np.stack([grey, np.roll(grey, 9, axis=1), 255 - grey], axis=-1)
    alpha = rng.integers(0, 256, size=grey.shape, dtype=np.uint8)
    return {"grey": grey, "rgba": np.dstack([rgb, alpha])}


@pytest.mark.slow
def test_grey_and_rgba_images_are_converted_as_documented(tmp_path_factory, tmp_path, images):
    """A grey image is its value in R, G and B; an RGBA image is its RGB (alpha dropped): as arrays, PIL images and
    files, the request the pipeline receives holds those pixels, and the frames are those of the explicit RGB."""
    grey, rgba = images["grey"], images["rgba"]
    explicit = {"grey": np.repeat(grey[..., None], 3, axis=2), "rgba": np.ascontiguousarray(rgba[..., :3])}
    composited = (rgba[..., :3].astype(np.float64) * rgba[..., 3:] / 255).round().astype(np.uint8)
    assert max_abs_diff(composited, explicit["rgba"]) > 100, "compositing must differ from dropping alpha"
    model = family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        for name, pixels in images.items():
            Image.fromarray(pixels).save(tmp_path / f"{name}.png")
            for given in (pixels, Image.fromarray(pixels), str(tmp_path / f"{name}.png")):
                request = GenerationRequest(prompt="a fox", image=given, save_video=False, **IMAGE_REQUEST)
                received = gen.model_info.resolve_request(request).image
                assert received.dtype == np.uint8 and np.array_equal(received, explicit[name]), (name, type(given))
        frames = {
            name: gen.generate("a fox", image=pixels, save_video=False, **IMAGE_REQUEST).frames
            for name, pixels in [*images.items(), *((f"{n}-explicit", p) for n, p in explicit.items())]
        }
    assert max_abs_diff(frames["grey-explicit"], frames["rgba-explicit"]) > 10, "the image must matter"
    for name in images:
        assert np.array_equal(frames[name], frames[f"{name}-explicit"]), name
