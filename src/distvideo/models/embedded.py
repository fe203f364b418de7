"""The models shipped as package data: the embedded default (the trained demo model) and the tiny random one."""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets"

#: The tiny random-weight model (draws noise): the test suite's fast model, rebuilt byte for byte by
#: ``scripts/make_embedded_model.py``.
TINY_MODEL_DIR = _ASSETS / "tiny-wan"
#: The demo model: a small Wan2.1-architecture model trained on moving shapes (docs/demo-model.md), made by
#: ``scripts/train_demo_model.py``. It is the embedded default; the suite keeps the tiny model (tests/conftest.py).
DEMO_MODEL_DIR = _ASSETS / "demo-wan"
#: The embedded default model: the model used when none is given (and DISTVIDEO_MODEL is unset).
EMBEDDED_MODEL_DIR = DEMO_MODEL_DIR
#: A caption of the demo model's grammar (docs/demo-model.md): colour, shape, direction, background
DEMO_EXAMPLE_PROMPT = "a red ball moving right on a black background"
#: What a page suggests for any other model (a scene, not the demo's grammar)
GENERIC_EXAMPLE_PROMPT = "a red fox running through fresh snow at dawn"
IMAGE_EXAMPLE_PROMPT = "the scene in the image comes to life, the camera slowly pushing in"


def example_prompt(model_dir: Path, takes_image: bool) -> str:
    """A prompt that fits the model at `model_dir`: the demo model's grammar for the demo model (other words give
    it an arbitrary blob), a description of motion for an image-to-video model, else a scene."""
    if model_dir.resolve() == DEMO_MODEL_DIR.resolve():
        return DEMO_EXAMPLE_PROMPT
    return IMAGE_EXAMPLE_PROMPT if takes_image else GENERIC_EXAMPLE_PROMPT


def _shipped(path: Path, what: str, remedy: str) -> Path:
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"the {what} is missing at {path}; {remedy}")
    return path


def embedded_model_path() -> Path:
    """Path of the embedded default model shipped with the package: the trained demo model."""
    return _shipped(EMBEDDED_MODEL_DIR, "embedded demo model", "reinstall distvideo (see docs/demo-model.md)")


def tiny_model_path() -> Path:
    """Path of the tiny random-weight model shipped with the package (fast; for tests and smoke runs)."""
    return _shipped(TINY_MODEL_DIR, "tiny model", "regenerate it with `python scripts/make_embedded_model.py`")
