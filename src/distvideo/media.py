"""Video files: MP4 (H.264, yuv420p, BT.709) written atomically and reproducibly, and what can be checked about a
request's video before generating it.

A video is encoded into a file that has no name yet (Linux O_TMPFILE; elsewhere a hidden temporary
file) in the target folder and linked into place only when complete, so a crash, even SIGKILL, never
leaves a partial file at the output path; an existing file is never overwritten. Output names and folders follow
distvideo.paths.
"""

from __future__ import annotations

import ctypes
import functools
import io
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from distvideo.errors import ConfigError, VideoWriteError
from distvideo.paths import check_output_target, first_free, resolve_output_path


def check_encoder(width: int, height: int, fps: int) -> None:
    """Refuse (ConfigError) settings the encoder would reject after the whole generation: open it once, with no
    frame, in memory."""
    import av

    if width % 2 or height % 2:
        raise ConfigError(f"width={width}, height={height}: H.264 yuv420p needs an even width and height")
    try:
        with av.open(io.BytesIO(), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=fps, options=dict(X264_OPTIONS))
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.codec_context.open()
    except (av.FFmpegError, ValueError) as exc:
        raise ConfigError(f"the video encoder refuses {width}x{height} at fps={fps}: {exc}") from None


# --- encoding -------------------------------------------------------------------------------------------------------
# The same frames must give the same bytes in every process, on every executor and machine with the same library
# versions. Two things stood in the way, both fixed here by construction:
#  * x264's MB-tree rate control, on CPUs with AVX-512, reads memory the encoder never initialised, so the bitstream
#    depended on what the heap held before (measured: the same frames, encoded after filling freed heap memory with
#    0x00 and with 0xFF, gave two different files at 48x32, 96x160 and 480x832; with MB-tree off, or with x264 limited
#    to AVX2, the files were identical). MB-tree is therefore off (`mbtree=0`); it costs a few percent of bitrate.
#  * x264's output depends on its thread count, which by default follows the machine's cores: it is fixed.
# The RGB -> YUV conversion is ours, in integers (BT.709, limited range, 2x2 box-filtered chroma), so it does not
# depend on swscale's version or SIMD path either, and the stream is tagged to match so players show the model's
# colours.
X264_OPTIONS = {"crf": "18", "preset": "medium", "x264-params": "mbtree=0"}
X264_THREADS = 4  # fixed: the bitstream depends on it; 4 frame threads keep large videos quick on most machines
BT709 = 1  # AVCOL_PRI_BT709 == AVCOL_TRC_BT709 == AVCOL_SPC_BT709 in FFmpeg
LIMITED_RANGE = 1  # AVCOL_RANGE_MPEG: Y in 16..235, Cb/Cr in 16..240

_FRACTION_BITS = 16  # fixed-point precision of the conversion coefficients
_KR, _KB = 0.2126, 0.0722  # BT.709 luma weights of red and blue


def _fixed(values: tuple[float, float, float]) -> np.ndarray:
    return np.array([round(v * (1 << _FRACTION_BITS)) for v in values], dtype=np.int32)


def _bt709_limited_coefficients() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer (R, G, B) weights of Y, Cb and Cr, in units of 2**-16, from BT.709's definition:
    Y = 16 + 219 * E'y, Cb = 128 + 224 * (E'b - E'y) / (2 (1 - Kb)), Cr = 128 + 224 * (E'r - E'y) / (2 (1 - Kr)),
    with E' = code / 255. The chroma weights of green are adjusted so each row sums to exactly zero, so every grey
    gives Cb = Cr = 128 exactly."""
    kg = 1.0 - _KR - _KB
    y = _fixed((219 / 255 * _KR, 219 / 255 * kg, 219 / 255 * _KB))
    cb_scale, cr_scale = 224 / 255 / (2 * (1 - _KB)), 224 / 255 / (2 * (1 - _KR))
    cb = _fixed((-_KR * cb_scale, -kg * cb_scale, (1 - _KB) * cb_scale))
    cr = _fixed(((1 - _KR) * cr_scale, -kg * cr_scale, -_KB * cr_scale))
    cb[1] = -(cb[0] + cb[2])
    cr[1] = -(cr[0] + cr[2])
    return y, cb, cr


_Y_WEIGHTS, _CB_WEIGHTS, _CR_WEIGHTS = _bt709_limited_coefficients()


def rgb_to_yuv420p(frame: np.ndarray) -> np.ndarray:
    """One uint8 RGB frame (H, W, 3), any strides, as yuv420p planes stacked the way PyAV takes them: a (3H/2, W) uint8
    array holding Y (H x W), then Cb and Cr (H/2 x W/2 each). BT.709, limited range, in exact integer arithmetic
    (rounded to nearest); chroma is the rounded mean of each 2x2 block. H and W must be even."""
    h, w, _ = frame.shape
    rgb = frame.astype(np.int32)
    one_half = 1 << (_FRACTION_BITS - 1)
    y = (rgb @ _Y_WEIGHTS + ((16 << _FRACTION_BITS) + one_half)) >> _FRACTION_BITS
    planes = [y.astype(np.uint8).reshape(-1)]
    # Sum the full-resolution chroma of each 2x2 block first (exact), then divide by 4 and round once.
    for weights in (_CB_WEIGHTS, _CR_WEIGHTS):
        full = rgb @ weights
        block = full[0::2, 0::2] + full[0::2, 1::2] + full[1::2, 0::2] + full[1::2, 1::2]
        shift = _FRACTION_BITS + 2
        chroma = (block + ((128 << shift) + (1 << (shift - 1)))) >> shift
        planes.append(chroma.astype(np.uint8).reshape(-1))
    return np.concatenate(planes).reshape(h * 3 // 2, w)


def _encode_mp4(frames: np.ndarray, file: BinaryIO, fps: int) -> None:
    """H.264 in MP4, yuv420p BT.709 limited range (plays in browsers), with PyAV into a seekable file object; the
    same frames give the same bytes (see the notes above)."""
    import av

    t, h, w, _ = frames.shape
    with av.open(file, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options=dict(X264_OPTIONS))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        context = stream.codec_context
        context.thread_count = X264_THREADS
        context.color_range = LIMITED_RANGE
        context.colorspace = context.color_primaries = context.color_trc = BT709
        for i in range(t):
            frame = av.VideoFrame.from_ndarray(rgb_to_yuv420p(frames[i]), format="yuv420p")
            frame.color_range, frame.colorspace = LIMITED_RANGE, BT709
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


class _PendingFile:
    """A file that has no name until `publish`: an O_TMPFILE inode where the filesystem supports it
    (if the process is killed, nothing at all is left), else a hidden temporary beside the target."""

    def __init__(self, folder: Path):
        self.named: Path | None = None
        try:
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o666)  # the umask applies, as to any new file
        except (AttributeError, OSError):
            self.named = folder / f".distvideo-{os.getpid()}-{uuid.uuid4().hex[:8]}.partial.mp4"
            fd = os.open(self.named, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o666)
        self.file: BinaryIO = os.fdopen(fd, "w+b")

    def _link(self, target: Path) -> None:
        """Give the file the name `target`; FileExistsError if it is taken (never overwrites)."""
        if self.named is not None:
            os.link(self.named, target)
            return
        # linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N names an O_TMPFILE inode; os.link does not pass the flag
        ret = _libc().linkat(-100, f"/proc/self/fd/{self.file.fileno()}".encode(), -100, bytes(target), 0x400)
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(target))

    def publish(self, target: Path, *, replace: bool = False) -> Path:
        """Name the file `target` (the next free `_N` name if taken), or, with `replace`, put it in place of whatever
        is at `target` in one rename (batch outputs, which the job owns)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        if replace:
            # a name of fixed length, whatever the target's (a target's name may be as long as a name can be)
            staging = target.with_name(f".distvideo-{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
            self._link(staging)
            try:
                os.replace(staging, target)
            except BaseException:
                staging.unlink(missing_ok=True)
                raise
            return target
        while True:
            try:
                self._link(target)
                return target
            except FileExistsError:
                target = first_free(target)

    def discard(self) -> None:
        self.file.close()
        if self.named is not None:
            self.named.unlink(missing_ok=True)


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def write_video(
    frames: np.ndarray,
    path: str | Path,
    fps: int = 16,
    *,
    encode: Callable[[np.ndarray, BinaryIO, int], None] | None = None,
    replace: bool = False,
) -> Path:
    """Write uint8 frames (T, H, W, 3) to `path` atomically and return the final path; with `replace`, in place of
    an existing file at `path` (one rename: readers see the old file or the new one).

    The video is encoded into a file without a name (or a hidden temporary one) in the target folder
    and linked into place only after the encoder finished; linking never overwrites, so if `path`
    appeared meanwhile the next free `_N` name is used. On any failure nothing exists at `path`.
    """
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"H.264 yuv420p needs even height and width, got {frames.shape[1]}x{frames.shape[2]}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    pending = _PendingFile(target.parent)
    try:
        (encode or _encode_mp4)(frames, pending.file, fps)
        return pending.publish(target, replace=replace)
    finally:
        pending.discard()


def write_array(array: np.ndarray, path: str | Path) -> Path:
    """Save an array as .npy atomically (the video writer's fallback); never over an existing entry."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    pending = _PendingFile(target.parent)
    try:
        np.save(pending.file, array, allow_pickle=False)
        return pending.publish(target)
    finally:
        pending.discard()


def check_video_output(
    output_path: str | None, prompt: str, seed: int, width: int, height: int, fps: int, name: str = "output_path"
) -> Path:
    """Everything about writing a request's video that can be checked before generating it (the path, the folder,
    the encoder's settings); ConfigError naming the parameter as `name` on a problem, else the path the video would
    get now."""
    check_encoder(width, height, fps)
    target = resolve_output_path(output_path, prompt, seed)
    check_output_target(target, name)  # last: the costliest (it makes the folder and a file, and removes them)
    return target


FRAMES_ON_ERROR = "; the frames are on this error (.frames)"  # the API's caller holds it; a command's ends with it


def write_video_or_keep_frames(frames: np.ndarray, target: Path, fps: int) -> Path:
    """Write the video; if that fails after all (the disk filled up, the folder vanished), keep the frames: saved
    beside the target as `<name>.frames.npy` (np.load), or, if even that fails, on the raised error."""
    try:
        return write_video(frames, target, fps=fps)
    except Exception as exc:
        fallback = target.with_name(f"{target.stem}.frames.npy")
        try:
            saved = write_array(frames, fallback)
        except Exception:
            raise VideoWriteError(
                f"writing {target} failed ({type(exc).__name__}: {exc}) and so did saving the frames beside it"
                + FRAMES_ON_ERROR,
                None,
                frames,
            ) from exc
        raise VideoWriteError(
            f"writing {target} failed ({type(exc).__name__}: {exc}); the frames were saved to {saved} "
            "(numpy.load) so the generation is not lost",
            saved,
            None,
        ) from exc
