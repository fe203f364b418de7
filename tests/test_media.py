"""Output paths and atomic MP4 writing."""

from __future__ import annotations

import numpy as np
import pytest

from distvideo.media import resolve_output_path, sanitize_prompt, write_video

from conftest import read_video


def frames(t=5, h=32, w=48):
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, size=(t, h, w, 3), dtype=np.uint8)


def test_sanitize_prompt():
    assert sanitize_prompt("A Cat, on a Boat!") == "a_cat_on_a_boat"
    assert sanitize_prompt("日本語") == "video"
    assert len(sanitize_prompt("word " * 100)) <= 60


def test_resolve_output_path(tmp_path):
    assert resolve_output_path(str(tmp_path / "x.mp4"), "p", 1) == tmp_path / "x.mp4"
    assert resolve_output_path(str(tmp_path), "a b", 3) == tmp_path / "a_b_seed3.mp4"
    (tmp_path / "x.mp4").write_bytes(b"old")
    (tmp_path / "x_1.mp4").write_bytes(b"old")
    assert resolve_output_path(str(tmp_path / "x.mp4"), "p", 1) == tmp_path / "x_2.mp4"


def test_write_video_roundtrip(tmp_path):
    path = write_video(frames(), tmp_path / "sub" / "v.mp4", fps=8)
    decoded, codec, pix_fmt = read_video(path)
    assert decoded.shape == (5, 32, 48, 3) and codec == "h264" and pix_fmt == "yuv420p"
    assert sorted(p.name for p in path.parent.iterdir()) == ["v.mp4"]


def test_write_video_never_overwrites_a_file_that_appeared(tmp_path):
    target = tmp_path / "v.mp4"

    def encode_then_race(fr, file, fps):
        file.write(b"video")
        target.write_bytes(b"someone else's")  # appears while we encode

    final = write_video(frames(), target, encode=encode_then_race)
    assert final == tmp_path / "v_1.mp4"
    assert target.read_bytes() == b"someone else's" and final.read_bytes() == b"video"


def test_write_video_failure_leaves_nothing(tmp_path):
    def crash(fr, file, fps):
        file.write(b"partial")
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError, match="encoder crashed"):
        write_video(frames(), tmp_path / "v.mp4", encode=crash)
    assert list(tmp_path.iterdir()) == []


def test_write_video_rejects_bad_frames(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        write_video(frames().astype(np.float32), tmp_path / "v.mp4")
    assert list(tmp_path.iterdir()) == []


def test_killed_while_encoding_leaves_nothing(tmp_path):
    """SIGKILL in the middle of encoding: no file at or beside the output path."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import sys, time, numpy as np\n"
        "from distvideo.media import write_video\n"
        "def slow(frames, file, fps):\n"
        "    file.write(b'x' * 4096); file.flush(); print('encoding', flush=True); time.sleep(60)\n"
        f"write_video(np.zeros((1, 8, 8, 3), np.uint8), {str(tmp_path / 'v.mp4')!r}, encode=slow)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "encoding"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(0.1)
    assert list(tmp_path.iterdir()) == []
