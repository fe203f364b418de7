"""Video files: choosing the output path and writing MP4 (H.264, yuv420p, BT.709) atomically and reproducibly; and
the conditioning image of image-to-video requests (read, checked and fingerprinted).

A video is encoded into a file that has no name yet (Linux O_TMPFILE; elsewhere a hidden temporary
file) in the target folder and linked into place only when complete, so a crash, even SIGKILL, never
leaves a partial file at the output path; an existing file is never overwritten.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import io
import os
import re
import unicodedata
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from distvideo.errors import ConfigError

_MAX_STEM = 60


def sanitize_prompt(prompt: str) -> str:
    """A file-name-safe stem from a prompt: its words transliterated to ASCII (anyascii: 'Кошка' -> 'koshka',
    '日本' -> 'riben') and joined by '_', at most 60 characters. A prompt that is not plain ASCII also gets 8 hex
    digits of its hash, so two prompts that read alike in ASCII keep apart names."""
    from anyascii import anyascii

    normalized = unicodedata.normalize("NFC", prompt)
    words = re.findall(r"[A-Za-z0-9]+", anyascii(normalized).lower())
    stem = "_".join(words)[:_MAX_STEM].strip("_") or "video"
    if not normalized.isascii():
        stem = f"{stem[: _MAX_STEM - 9]}_{hashlib.sha256(normalized.encode()).hexdigest()[:8]}"
    return stem


def resolve_output_path(output: str | None, prompt: str, seed: int, default_dir: str = "outputs") -> Path:
    """`output` ending in .mp4 is a file; otherwise (or None) a folder where the name comes from the
    prompt and seed. Never an existing entry (a dangling symlink counts): `_1`, `_2`, ... are appended until the
    name is free."""
    if output is not None and output.lower().endswith(".mp4"):
        target = Path(output)
    else:
        folder = Path(output) if output else Path(default_dir)
        target = folder / f"{sanitize_prompt(prompt)}_seed{seed}.mp4"
    return _first_free(target)


def _first_free(target: Path) -> Path:
    if not os.path.lexists(target):
        return target
    n = 1
    while True:
        candidate = target.with_name(f"{target.stem}_{n}{target.suffix}")
        if not os.path.lexists(candidate):
            return candidate
        n += 1


def check_output_target(target: Path) -> None:
    """Refuse (ConfigError) an output the writer could not create, before any work: a folder that is a file, a
    folder or the nearest existing ancestor not writable, a name too long for the file system."""
    from distvideo.config import path_problem

    problem = path_problem(str(target))
    if problem:
        raise ConfigError(f"output_path {str(target)!r}: {problem}")
    folder = target.parent
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_path {str(target)!r}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "the folder" if existing == folder else f"{existing}, where its folder would be created,"
        raise ConfigError(f"output_path {str(target)!r}: {what} is not writable by this user")


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
            staging = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
            self._link(staging)
            os.replace(staging, target)
            return target
        while True:
            try:
                self._link(target)
                return target
            except FileExistsError:
                target = _first_free(target)

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


def check_video_output(output_path: str | None, prompt: str, seed: int, width: int, height: int, fps: int) -> Path:
    """Everything about writing a request's video that can be checked before generating it (the path, the folder,
    the encoder's settings); ConfigError on a problem, else the path the video would get now."""
    target = resolve_output_path(output_path, prompt, seed)
    check_output_target(target)
    check_encoder(width, height, fps)
    return target


# --- conditioning images --------------------------------------------------------------------------------------------
IMAGE_FORMS = "a file path, a PIL image or a uint8 array (H, W, 3)"


def check_image_type(image: Any) -> None:
    """ConfigError unless `image` is a path, a PIL image or a uint8 (H, W), (H, W, 3) or (H, W, 4) array (no file
    is read)."""
    if isinstance(image, (str, os.PathLike)):
        if not os.fspath(image):
            raise ConfigError(f"image: empty path; pass {IMAGE_FORMS}")
        return
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise ConfigError(
                f"image: an array must be uint8 of shape (H, W, 3) (RGB), (H, W, 4) or (H, W); got {image.dtype} "
                f"{image.shape}"
            )
        if min(image.shape[:2]) < 1:
            raise ConfigError(f"image: the array has no pixels (shape {image.shape})")
        return
    if not _is_pil_image(image):
        raise ConfigError(f"image: expected {IMAGE_FORMS}, got {type(image).__name__}")


def _is_pil_image(image: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - PIL comes with diffusers
        return False
    return isinstance(image, Image.Image)


def load_image(image: Any) -> np.ndarray:
    """The RGB pixels (H, W, 3) uint8 of a path, PIL image or array (alpha dropped, grey expanded); ConfigError
    naming the file when it is missing or not an image."""
    from PIL import Image, UnidentifiedImageError

    check_image_type(image)
    if isinstance(image, np.ndarray):
        pil = Image.fromarray(image)
    elif isinstance(image, (str, os.PathLike)):
        path = Path(image).expanduser()
        if not path.is_file():
            raise ConfigError(f"image: {str(path)!r} does not exist on host {_hostname()} (or is not a file)")
        try:
            with Image.open(path) as opened:
                pil = opened.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise ConfigError(f"image: {str(path)!r} is not an image PIL can read ({exc})") from None
    else:
        pil = image
    return np.ascontiguousarray(np.asarray(pil.convert("RGB"), dtype=np.uint8))


def image_fingerprint(image: Any) -> str | None:
    """What ranks compare to agree on an image: the sha256 of its pixels (paths: of the file's bytes, so the same
    file at different paths agrees), "missing" for a file that cannot be read here, None for no image."""
    import hashlib

    if image is None:
        return None
    digest = hashlib.sha256()
    if isinstance(image, (str, os.PathLike)):
        try:
            digest.update(Path(image).expanduser().read_bytes())
        except OSError as exc:
            return f"not readable on {_hostname()} ({type(exc).__name__})"
        return "file sha256 " + digest.hexdigest()[:16]
    if _is_pil_image(image):
        digest.update(f"{image.mode} {image.size}".encode())
        digest.update(image.tobytes())
    else:
        array = np.ascontiguousarray(image)
        digest.update(f"{array.dtype} {array.shape}".encode())
        digest.update(array.tobytes())
    return "pixels sha256 " + digest.hexdigest()[:16]


def _hostname() -> str:
    import socket

    return socket.gethostname()
