"""Video files: choosing the output path and writing MP4 (H.264, yuv420p) atomically.

A video is encoded into a temporary file in the target folder and moved into place only when
complete, so a crash never leaves a partial file at the output path; an existing file is never
overwritten.
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path

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


def _encode_mp4(frames: np.ndarray, path: Path, fps: int) -> None:
    import imageio_ffmpeg

    t, h, w, _ = frames.shape
    writer = imageio_ffmpeg.write_frames(
        str(path),
        (w, h),
        fps=fps,
        codec="libx264",
        pix_fmt_in="rgb24",
        pix_fmt_out="yuv420p",
        macro_block_size=1,
        quality=None,
        output_params=["-f", "mp4", "-crf", "18", "-movflags", "+faststart"],
        ffmpeg_log_level="error",
    )
    writer.send(None)
    for i in range(t):
        writer.send(np.ascontiguousarray(frames[i]))
    writer.close()


def write_video(
    frames: np.ndarray,
    path: str | Path,
    fps: int = 16,
    *,
    encode: Callable[[np.ndarray, Path, int], None] | None = None,
) -> Path:
    """Write uint8 frames (T, H, W, 3) to `path` atomically and return the final path.

    The video goes to a hidden temporary file beside `path` and is linked into place only after the
    encoder finished; if `path` appeared meanwhile the next free `_N` name is used. On any failure the
    temporary file is removed and nothing exists at `path`.
    """
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"H.264 yuv420p needs even height and width, got {frames.shape[1]}x{frames.shape[2]}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.partial.mp4")
    try:
        (encode or _encode_mp4)(frames, tmp, fps)
        while True:
            try:
                os.link(tmp, target)  # atomic and never overwrites
                break
            except FileExistsError:
                target = _first_free(target)
            except OSError:  # a filesystem without hard links: check, then rename
                if target.exists():
                    target = _first_free(target)
                    continue
                os.replace(tmp, target)
                break
    finally:
        tmp.unlink(missing_ok=True)
    return target
