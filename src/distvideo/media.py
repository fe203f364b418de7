"""Video files: choosing the output path and writing MP4 (H.264, yuv420p) atomically.

A video is encoded into a file that has no name yet (Linux O_TMPFILE; elsewhere a hidden temporary
file) in the target folder and linked into place only when complete, so a crash, even SIGKILL, never
leaves a partial file at the output path; an existing file is never overwritten.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import unicodedata
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_MAX_STEM = 60


def sanitize_prompt(prompt: str) -> str:
    """A file-name-safe stem from a prompt: ASCII words joined by '_', at most 60 characters."""
    ascii_text = unicodedata.normalize("NFKD", prompt).encode("ascii", "ignore").decode()
    words = re.findall(r"[A-Za-z0-9]+", ascii_text.lower())
    stem = "_".join(words)[:_MAX_STEM].strip("_")
    return stem or "video"


def resolve_output_path(output: str | None, prompt: str, seed: int, default_dir: str = "outputs") -> Path:
    """`output` ending in .mp4 is a file; otherwise (or None) a folder where the name comes from the
    prompt and seed. Never an existing file: `_1`, `_2`, ... are appended until the name is free."""
    if output is not None and output.lower().endswith(".mp4"):
        target = Path(output)
    else:
        folder = Path(output) if output else Path(default_dir)
        target = folder / f"{sanitize_prompt(prompt)}_seed{seed}.mp4"
    return _first_free(target)


def _first_free(target: Path) -> Path:
    if not target.exists():
        return target
    n = 1
    while True:
        candidate = target.with_name(f"{target.stem}_{n}{target.suffix}")
        if not candidate.exists():
            return candidate
        n += 1


def _encode_mp4(frames: np.ndarray, file: BinaryIO, fps: int) -> None:
    """H.264 in MP4, yuv420p (plays in browsers), with PyAV into a seekable file object."""
    import av

    t, h, w, _ = frames.shape
    with av.open(file, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "18", "preset": "medium"})
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(t):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[i]), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


class _PendingFile:
    """A file that has no name until `publish`: an O_TMPFILE inode where the filesystem supports it
    (if the process is killed, nothing at all is left), else a hidden temporary beside the target."""

    def __init__(self, folder: Path):
        self.named: Path | None = None
        try:
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o644)
        except (AttributeError, OSError):
            self.named = folder / f".distvideo-{os.getpid()}-{uuid.uuid4().hex[:8]}.partial.mp4"
            fd = os.open(self.named, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
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

    def publish(self, target: Path) -> Path:
        self.file.flush()
        os.fsync(self.file.fileno())
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
) -> Path:
    """Write uint8 frames (T, H, W, 3) to `path` atomically and return the final path.

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
        return pending.publish(target)
    finally:
        pending.discard()
