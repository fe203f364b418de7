"""The conditioning image of image-to-video requests: its accepted forms checked (no file read), its pixels read, and
its fingerprint, which ranks compare to agree on it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from distvideo.errors import ConfigError

IMAGE_FORMS = "a file path, a PIL image or a uint8 array (H, W, 3)"


def check_image_type(image: Any, label: str = "image") -> None:
    """ConfigError unless `image` is a path, a PIL image or a uint8 (H, W), (H, W, 3) or (H, W, 4) array (no file
    is read). `label`: the option as the user named it (`--image`)."""
    if isinstance(image, (str, os.PathLike)):
        if not os.fspath(image):
            raise ConfigError(f"{label}: empty path; pass {IMAGE_FORMS}", param="image")
        return
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise ConfigError(
                f"{label}: an array must be uint8 of shape (H, W, 3) (RGB), (H, W, 4) or (H, W); got {image.dtype} "
                f"{image.shape}",
                param="image",
            )
        if min(image.shape[:2]) < 1:
            raise ConfigError(f"{label}: the array has no pixels (shape {image.shape})", param="image")
        return
    if not _is_pil_image(image):
        raise ConfigError(f"{label}: expected {IMAGE_FORMS}, got {type(image).__name__}", param="image")


def _is_pil_image(image: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - PIL comes with diffusers
        return False
    return isinstance(image, Image.Image)


def load_image(image: Any, label: str = "image") -> np.ndarray:
    """The RGB pixels (H, W, 3) uint8 of a path, PIL image or array (alpha dropped, grey expanded); ConfigError
    naming the file when it is missing, not an image, or over PIL's pixel limit (`PIL.Image.MAX_IMAGE_PIXELS`: a
    decompression bomb), which is checked from its header before any pixel is decoded. `label`: the option as the
    user named it (`--image`)."""
    from PIL import Image, UnidentifiedImageError

    check_image_type(image, label)
    if isinstance(image, np.ndarray):
        pil = Image.fromarray(image)
    elif isinstance(image, (str, os.PathLike)):
        path = Path(image).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"{label}: {str(path)!r} does not exist on host {_hostname()} (or is not a file)", param="image"
            )
        try:
            with Image.open(path) as opened:  # reads the header only; raises over twice MAX_IMAGE_PIXELS
                _check_pixel_limit(opened.width, opened.height)  # PIL only warns below twice it, then decodes
                pil = opened.convert("RGB")
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # the warning under -W error
            raise ConfigError(f"{label}: {str(path)!r} is too large to read ({exc})", param="image") from None
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise ConfigError(f"{label}: {str(path)!r} is not an image PIL can read ({exc})", param="image") from None
    else:
        pil = image
    return np.ascontiguousarray(np.asarray(pil.convert("RGB"), dtype=np.uint8))


def _check_pixel_limit(width: int, height: int) -> None:
    """PIL's DecompressionBombError for an image over `PIL.Image.MAX_IMAGE_PIXELS` (None: no limit); PIL itself
    raises only over twice the limit (below, it warns and decodes). Checked without touching the warning filters,
    which are global to the process (the service reads images on several threads)."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise Image.DecompressionBombError(
            f"{width}x{height} = {width * height} pixels; at most {limit} are read (PIL.Image.MAX_IMAGE_PIXELS)"
        )


def image_fingerprint(image: Any) -> str | None:
    """What ranks compare to agree on an image: the sha256 of its pixels (paths: of the file's bytes, so the same
    file at different paths agrees), "missing" for a file that cannot be read here, None for no image."""
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
