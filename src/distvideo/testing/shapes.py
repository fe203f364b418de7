"""A procedural, deterministic video dataset: one shape moving in a straight line over a plain background.

Every clip has a caption from a small grammar::

    a {color} {shape} moving {direction} on a {background} background

with colours red, green, blue, yellow, white; shapes ball, square, triangle; directions left, right, up, down; and
backgrounds black, gray, white (never the shape's own colour): 168 captions in all. Size, speed and start position
vary per clip; the shape always travels at least :data:`MIN_TRAVEL` of the frame along its direction and stays inside
the frame. Clips are rendered with anti-aliased edges (coverage from a signed distance), as uint8 ``(T, H, W, 3)``.

The demo model (``scripts/train_demo_model.py``) is trained on these clips, and :mod:`distvideo.testing.video_check`
checks generated videos against their caption with the same palette. ``sample_clip(seed, i)`` is a pure function of
its arguments: the same arguments give the same bytes on every machine.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from distvideo.models.embedded import DEMO_CAPTION

__all__ = [
    "BACKGROUNDS",
    "COLORS",
    "DIRECTIONS",
    "MIN_TRAVEL",
    "SHAPES",
    "Caption",
    "all_captions",
    "parse_caption",
    "render_clip",
    "sample_clip",
]

#: Shape colours (sRGB).
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 70),
    "blue": (50, 90, 235),
    "yellow": (240, 215, 40),
    "white": (245, 245, 245),
}
#: Background colours (sRGB). "white" is the same colour as the white shape, so that pair never occurs.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (12, 12, 12),
    "gray": (128, 128, 128),
    "white": (245, 245, 245),
}
SHAPES: tuple[str, ...] = ("ball", "square", "triangle")
#: Unit motion per direction, as (dx, dy) in image coordinates (y grows downwards).
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

#: The least distance a shape travels over a clip, as a fraction of the frame side along its direction.
MIN_TRAVEL = 0.375
#: The most it travels.
MAX_TRAVEL = 0.6
#: Half-size of a shape (radius of a ball, half the side of a square), as a fraction of the frame's smaller side.
SIZE_RANGE = (0.13, 0.22)

_CAPTION = DEMO_CAPTION


@dataclasses.dataclass(frozen=True)
class Caption:
    color: str
    shape: str
    direction: str
    background: str

    def __post_init__(self) -> None:
        for value, allowed, name in (
            (self.color, COLORS, "color"),
            (self.shape, SHAPES, "shape"),
            (self.direction, DIRECTIONS, "direction"),
            (self.background, BACKGROUNDS, "background"),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {sorted(allowed)}")
        if self.color == self.background:
            raise ValueError(f"color={self.color!r} equals the background; the shape would be invisible")

    @property
    def text(self) -> str:
        return f"a {self.color} {self.shape} moving {self.direction} on a {self.background} background"

    def __str__(self) -> str:
        return self.text


def parse_caption(text: str) -> Caption:
    """The :class:`Caption` of a text in the grammar; ValueError for any other text."""
    match = _CAPTION.match(text.strip())
    if match is None:
        raise ValueError(
            f"{text!r} is not of the form 'a {{color}} {{shape}} moving {{direction}} on a {{background}} background'"
        )
    return Caption(*match.groups())


def all_captions() -> list[Caption]:
    """Every caption of the grammar (168), in a fixed order."""
    return [Caption(c, s, d, b) for c, s, d, b in itertools.product(COLORS, SHAPES, DIRECTIONS, BACKGROUNDS) if c != b]


def _coverage(shape: str, cx: float, cy: float, r: float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Fraction of each pixel covered by the shape, from a signed distance with a one-pixel ramp."""
    dx, dy = xs - cx, ys - cy
    if shape == "ball":
        dist = np.sqrt(dx * dx + dy * dy) - r
    elif shape == "square":
        dist = np.maximum(np.abs(dx), np.abs(dy)) - r
    else:  # upward-pointing equilateral-ish triangle inscribed in the square of half-side r
        # edges: bottom y = cy + r; left and right from the apex (cx, cy - r) to the bottom corners (cx -+ r, cy + r)
        bottom = dy - r
        slope = np.sqrt(5.0)  # normalise |(2, 1)|
        left = (-2.0 * dx - dy - r) / slope
        right = (2.0 * dx - dy - r) / slope
        dist = np.maximum(bottom, np.maximum(left, right))
    return np.clip(0.5 - dist, 0.0, 1.0)


def render_clip(
    caption: Caption,
    *,
    num_frames: int,
    height: int,
    width: int,
    start: tuple[float, float],
    travel: float,
    half_size: float,
) -> np.ndarray:
    """Render one clip: the shape's centre starts at ``start`` (x, y pixels) and moves ``travel`` pixels along the
    caption's direction at constant speed. Returns uint8 ``(num_frames, height, width, 3)``."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64) + 0.5
    fg = np.asarray(COLORS[caption.color], dtype=np.float64)
    bg = np.asarray(BACKGROUNDS[caption.background], dtype=np.float64)
    ux, uy = DIRECTIONS[caption.direction]
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        f = t / max(num_frames - 1, 1)
        cx, cy = start[0] + ux * travel * f, start[1] + uy * travel * f
        a = _coverage(caption.shape, cx, cy, half_size, xs, ys)[..., None]
        frames[t] = np.rint(a * fg + (1.0 - a) * bg).astype(np.uint8)
    return frames


def sample_clip(
    seed: int, index: int, *, num_frames: int = 17, height: int = 64, width: int = 64, caption: Caption | None = None
) -> tuple[Caption, np.ndarray]:
    """The ``index``-th clip of the dataset with ``seed``: its caption (uniform over :func:`all_captions` unless given)
    and its frames. Deterministic in all its arguments."""
    rng = np.random.default_rng([seed, index])
    captions = all_captions()
    pick = captions[int(rng.integers(len(captions)))]
    caption = caption or pick
    side = min(height, width)
    r = float(rng.uniform(*SIZE_RANGE)) * side
    ux, uy = DIRECTIONS[caption.direction]
    along = width if ux else height
    across = height if ux else width
    travel = float(rng.uniform(MIN_TRAVEL, MAX_TRAVEL)) * along
    margin = r + 1.0
    travel = min(travel, along - 2.0 * margin)  # a big shape travels less, so it never leaves the frame
    # the centre stays within [margin, along - margin] over the whole clip
    lo, hi = margin, max(margin, along - margin - travel)
    first = float(rng.uniform(lo, hi))
    if ux < 0 or uy < 0:  # moving towards 0: start from the far end
        first = along - first
    cross = float(rng.uniform(margin, across - margin))
    start = (first, cross) if ux else (cross, first)
    frames = render_clip(
        caption, num_frames=num_frames, height=height, width=width, start=start, travel=travel, half_size=r
    )
    return caption, frames
