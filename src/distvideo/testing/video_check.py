"""Does a video show its caption? A check of frames against a caption of the shapes grammar (:mod:`.shapes`).

The check is what the demo model promises, measured on pixels:

- the background is the median colour of the frame borders;
- foreground pixels are those farther than :data:`FOREGROUND_DISTANCE` (RGB, 0-255) from it, each classified as the
  nearest colour of the palette; the *dominant colour* is the most frequent class over all frames, and must be the
  caption's colour;
- the centroid of that colour's pixels, fitted by a straight line over the frames, must move in the caption's
  direction by at least :data:`MIN_MOVE` of the frame side along it, and farther along it than across it.

The shape's kind (ball, square, triangle) is not checked: at 64 pixels a blurred square and a ball are hard to tell
apart by a rule, and the issue's promise is colour and motion.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distvideo.testing.shapes import COLORS, DIRECTIONS, Caption, parse_caption

__all__ = ["FOREGROUND_DISTANCE", "MIN_MOVE", "CheckResult", "check_video"]

#: RGB distance from the background above which a pixel belongs to the shape.
FOREGROUND_DISTANCE = 60.0
#: Least movement along the caption's direction, as a fraction of the frame side along it.
MIN_MOVE = 0.25
#: Fewest frames that must show the dominant colour for the motion to be measured.
MIN_FRAMES_SEEN = 0.5

_PALETTE_NAMES = list(COLORS)
_PALETTE = np.asarray([COLORS[n] for n in _PALETTE_NAMES], dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    caption: str
    ok: bool
    dominant_color: str | None
    #: centroid movement over the clip in pixels, (dx, dy) with y downwards
    movement: tuple[float, float]
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def _background(frames: np.ndarray) -> np.ndarray:
    border = np.concatenate(
        [
            frames[:, 0].reshape(-1, 3),
            frames[:, -1].reshape(-1, 3),
            frames[:, :, 0].reshape(-1, 3),
            frames[:, :, -1].reshape(-1, 3),
        ]
    )
    return np.median(border.astype(np.float32), axis=0)


def check_video(frames: np.ndarray, caption: Caption | str) -> CheckResult:
    """Check uint8 frames ``(T, H, W, 3)`` against ``caption`` (a :class:`Caption` or its text)."""
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (T, H, W, 3), got shape {frames.shape}")
    num_frames, height, width, _ = frames.shape
    pixels = frames.astype(np.float32)
    bg = _background(frames)
    foreground = np.linalg.norm(pixels - bg, axis=-1) > FOREGROUND_DISTANCE  # (T, H, W)
    if not foreground.any():
        return CheckResult(cap.text, False, None, (0.0, 0.0), "no pixel stands out from the background")
    # nearest palette colour of every foreground pixel
    fg_pixels = pixels[foreground]
    classes = np.linalg.norm(fg_pixels[:, None, :] - _PALETTE[None], axis=-1).argmin(axis=1)
    counts = np.bincount(classes, minlength=len(_PALETTE_NAMES))
    dominant = _PALETTE_NAMES[int(counts.argmax())]
    if dominant != cap.color:
        share = counts.max() / counts.sum()
        return CheckResult(
            cap.text, False, dominant, (0.0, 0.0), f"dominant colour is {dominant} ({share:.0%}), not {cap.color}"
        )
    # centroid of the dominant colour per frame
    labels = np.full(foreground.shape, -1, dtype=np.int64)
    labels[foreground] = classes
    mask = labels == _PALETTE_NAMES.index(dominant)
    ys, xs = np.mgrid[0:height, 0:width]
    times, cx, cy = [], [], []
    for t in range(num_frames):
        n = mask[t].sum()
        if n:
            times.append(t)
            cx.append(float(xs[mask[t]].mean()))
            cy.append(float(ys[mask[t]].mean()))
    if len(times) < max(2, MIN_FRAMES_SEEN * num_frames):
        return CheckResult(cap.text, False, dominant, (0.0, 0.0), f"{cap.color} is visible in only {len(times)} frames")
    span = num_frames - 1
    dx = float(np.polyfit(times, cx, 1)[0]) * span
    dy = float(np.polyfit(times, cy, 1)[0]) * span
    ux, uy = DIRECTIONS[cap.direction]
    along = dx * ux + dy * uy
    across = abs(dx * uy) + abs(dy * ux)
    side = width if ux else height
    if along < MIN_MOVE * side:
        return CheckResult(
            cap.text,
            False,
            dominant,
            (dx, dy),
            f"moved {along:.1f} px {cap.direction}, less than {MIN_MOVE:.0%} of {side} px",
        )
    if across >= along:
        return CheckResult(cap.text, False, dominant, (dx, dy), f"moved {across:.1f} px across, {along:.1f} px along")
    return CheckResult(cap.text, True, dominant, (dx, dy), "ok")
