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
