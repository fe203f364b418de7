"""Output paths, atomic MP4 writing, the exact colour conversion and byte-identical encoding."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from distvideo.media import rgb_to_yuv420p, write_video
from distvideo.paths import resolve_output_path, sanitize_prompt

from conftest import read_video


def frames(t=5, h=32, w=48):
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, size=(t, h, w, 3), dtype=np.uint8)


def test_sanitize_prompt():
    assert sanitize_prompt("A Cat, on a Boat!") == "a_cat_on_a_boat"
    assert sanitize_prompt("!?,") == "video"  # no word left: a generic stem
    assert sanitize_prompt("日本語").startswith("ribenyu_")  # transliterated, with a hash (tests/test_hardening.py)
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

    code = (
        "import sys, time, numpy as np\n"
        "from distvideo.media import write_video\n"
        "def slow(frames, file, fps):\n"
        "    file.write(b'x' * 4096); file.flush(); print('encoding', flush=True); time.sleep(60)\n"
        f"write_video(np.zeros((1, 8, 8, 3), np.uint8), {str(tmp_path / 'v.mp4')!r}, encode=slow)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "encoding"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)  # reaped: the kernel has closed its files
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert list(tmp_path.iterdir()) == []


# --- colour conversion ------------------------------------------------------------------------------------------------
def bt709_limited_reference(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BT.709 limited range in floating point, from the standard's definition (chroma averaged over 2x2 blocks)."""
    r, g, b = (rgb[..., i].astype(np.float64) / 255 for i in range(3))
    kr, kb = 0.2126, 0.0722
    ey = kr * r + (1 - kr - kb) * g + kb * b
    h, w = ey.shape
    cb = 128 + 224 * (b - ey) / (2 * (1 - kb))
    cr = 128 + 224 * (r - ey) / (2 * (1 - kr))

    def pool(plane):
        return plane.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3))

    return 16 + 219 * ey, pool(cb), pool(cr)


def split_planes(yuv: np.ndarray, h: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    flat = yuv.reshape(-1)
    q = (h // 2) * (w // 2)
    return (
        flat[: h * w].reshape(h, w),
        flat[h * w : h * w + q].reshape(h // 2, w // 2),
        flat[h * w + q :].reshape(h // 2, w // 2),
    )


def test_rgb_to_yuv_is_bt709_limited_range_rounded():
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    got = split_planes(rgb_to_yuv420p(rgb), 48, 64)
    for plane, ref in zip(got, bt709_limited_reference(rgb), strict=True):
        # fixed-point coefficients (2**-16) put the result within a hair of the rounded exact value
        assert np.abs(plane.astype(np.float64) - ref).max() < 0.51
    grey = np.full((4, 4, 3), 77, np.uint8)
    _, cb, cr = split_planes(rgb_to_yuv420p(grey), 4, 4)
    assert (cb == 128).all() and (cr == 128).all()
    black, white = (split_planes(rgb_to_yuv420p(np.full((2, 2, 3), v, np.uint8)), 2, 2)[0] for v in (0, 255))
    assert (black == 16).all() and (white == 235).all()


def test_conversion_does_not_depend_on_the_memory_layout():
    rng = np.random.default_rng(4)
    planar = rng.integers(0, 256, size=(3, 32, 48), dtype=np.uint8)  # the pipeline's channel-first layout
    view = planar.transpose(1, 2, 0)
    assert not view.flags["C_CONTIGUOUS"]
    assert np.array_equal(rgb_to_yuv420p(view), rgb_to_yuv420p(np.ascontiguousarray(view)))


def test_stream_is_tagged_as_encoded_and_decodes_to_the_same_colours(tmp_path):
    """Players convert with the stream's tags: decoding with them gives the colours back (within the codec's loss),
    while a player assuming BT.601 would shift saturated colours by 20 levels and more."""
    import av

    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (200, 50, 120), (255, 255, 255), (0, 0, 0)]
    image = np.zeros((64, 16 * len(colours), 3), np.uint8)
    for i, colour in enumerate(colours):
        image[:, 16 * i : 16 * (i + 1)] = colour
    path = write_video(np.stack([image] * 3), tmp_path / "colours.mp4", fps=8)
    with av.open(str(path)) as container:
        context = container.streams.video[0].codec_context
        assert (context.colorspace, context.color_primaries, context.color_trc, context.color_range) == (1, 1, 1, 1)
        decoded = next(container.decode(video=0)).to_ndarray(format="rgb24")
    centres = decoded[32, 8::16].astype(int)
    assert np.abs(centres - np.array(colours)).max() <= 3


# --- byte-identical files ---------------------------------------------------------------------------------------------
ENCODE_IN_A_FRESH_PROCESS = r"""
import ctypes, hashlib, io, sys, threading
import numpy as np
from distvideo.media import _encode_mp4

pattern, layout, paths = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]


SIZES = [64, 512, 4096, 65536, 200000, 1 << 20] * 4


def fill_freed_heap():  # freed heap memory holds `pattern`: what an encoder reads uninitialised now differs per process
    blocks = [libc.malloc(n) for n in SIZES]
    for block, n in zip(blocks, SIZES):
        ctypes.memset(block, pattern, n)
    for block in blocks:
        libc.free(block)


stop = threading.Event()
def allocate():  # other threads allocating and freeing while the encoder runs (ctypes calls release the GIL)
    while not stop.is_set():
        fill_freed_heap()
threads = [threading.Thread(target=allocate) for _ in range(2)]
for t in threads:
    t.start()
for path in paths:
    frames = np.load(path).transpose(0, 2, 3, 1)  # the pipeline's channel-first output, as the view it hands over
    if layout == "contiguous":
        frames = np.ascontiguousarray(frames)
    fill_freed_heap()
    buf = io.BytesIO()
    _encode_mp4(frames, buf, 16)
    print(hashlib.sha256(buf.getvalue()).hexdigest())
stop.set()
for t in threads:
    t.join()
"""


def test_the_same_frames_give_the_same_bytes_in_every_process(tmp_path):
    """The way it failed (x264's MB-tree reading uninitialised memory on AVX-512 CPUs): several processes, each with a
    different heap content and threads allocating meanwhile, encode the same frames from both memory layouts, at
    sizes where the old encoder settings gave a different file per heap content on such a CPU."""
    rng = np.random.default_rng(5)
    paths = []
    for t, h, w in [(5, 32, 48), (17, 96, 160), (9, 240, 416)]:
        ramp = np.linspace(0, 255, w)[None, None, :]
        planar = np.stack([np.roll(rng.integers(0, 80, (3, h, w)) + ramp, 2 * i, axis=2) for i in range(t)])
        paths.append(tmp_path / f"{t}x{h}x{w}.npy")
        np.save(paths[-1], planar.clip(0, 255).astype(np.uint8))
    outputs = []
    for pattern, layout in [(0x00, "view"), (0xFF, "view"), (0x55, "contiguous"), (0xFF, "contiguous")]:
        proc = subprocess.run(
            [sys.executable, "-c", ENCODE_IN_A_FRESH_PROCESS, str(pattern), layout, *map(str, paths)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.split())
    for i, path in enumerate(paths):
        assert len({digests[i] for digests in outputs}) == 1, (path.name, [digests[i] for digests in outputs])


def test_write_video_gives_the_same_file_twice(tmp_path):
    first = write_video(frames(), tmp_path / "a.mp4")
    second = write_video(frames().copy(order="F"), tmp_path / "b.mp4")
    assert hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(second.read_bytes()).digest()


# --- a filesystem without O_TMPFILE -----------------------------------------------------------------------------------
@pytest.fixture
def no_tmpfile_dir(tmp_path):
    """A folder on a FUSE filesystem (bindfs over a folder of tmp_path), where open(O_TMPFILE) fails: the writer's
    named-temporary fallback. Needs bindfs and root (make system-deps; CI runs as root)."""
    import errno
    import os
    import shutil

    if shutil.which("bindfs") is None:
        pytest.fail("bindfs is not installed: apt-get install -y bindfs (or: make system-deps)", pytrace=False)
    backing, mount = tmp_path / "backing", tmp_path / "fuse"
    backing.mkdir()
    mount.mkdir()
    proc = subprocess.run(["bindfs", str(backing), str(mount)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"bindfs could not mount (needs root and /dev/fuse): {proc.stderr}"
    try:
        with pytest.raises(OSError) as info:
            os.close(os.open(mount, os.O_TMPFILE | os.O_RDWR, 0o644))
        assert info.value.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL), info.value
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=60)


@pytest.mark.fuse
def test_writer_without_o_tmpfile_publishes_the_same_file(no_tmpfile_dir, tmp_path):
    reference = write_video(frames(), tmp_path / "reference.mp4")
    path = write_video(frames(), no_tmpfile_dir / "v.mp4")
    assert path == no_tmpfile_dir / "v.mp4"
    assert path.read_bytes() == reference.read_bytes()
    assert sorted(p.name for p in no_tmpfile_dir.iterdir()) == ["v.mp4"], "the named temporary was not removed"
    with pytest.raises(RuntimeError, match="encoder crashed"):

        def crash(fr, file, fps):
            file.write(b"partial")
            raise RuntimeError("encoder crashed")

        write_video(frames(), no_tmpfile_dir / "w.mp4", encode=crash)
    assert sorted(p.name for p in no_tmpfile_dir.iterdir()) == ["v.mp4"]


@pytest.mark.fuse
def test_killed_while_encoding_without_o_tmpfile_leaves_only_a_hidden_partial(no_tmpfile_dir):
    """Where O_TMPFILE does not exist the video is encoded into a hidden named file beside the output; a SIGKILL leaves
    that file (nothing can remove it), but never anything at the output path (docs/reliability.md says so)."""
    import os
    import re
    import signal

    code = (
        "import time, numpy as np\n"
        "from distvideo.media import write_video\n"
        "def slow(frames, file, fps):\n"
        "    file.write(b'x' * 4096); file.flush(); print('encoding', flush=True); time.sleep(60)\n"
        f"write_video(np.zeros((1, 8, 8, 3), np.uint8), {str(no_tmpfile_dir / 'v.mp4')!r}, encode=slow)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "encoding"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    left = [p.name for p in no_tmpfile_dir.iterdir()]
    assert not (no_tmpfile_dir / "v.mp4").exists()
    assert len(left) == 1 and re.fullmatch(rf"\.distvideo-{proc.pid}-[0-9a-f]{{8}}\.partial\.mp4", left[0]), left
