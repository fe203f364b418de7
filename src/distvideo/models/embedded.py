"""The models shipped as package data: the embedded default model and the tiny random-weight model."""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets"

#: The tiny random-weight model (draws noise): the test suite's fast model, rebuilt byte for byte by
#: ``scripts/make_embedded_model.py``.
TINY_MODEL_DIR = _ASSETS / "tiny-wan"
#: Where the trained demo model (docs/demo-model.md, issue 18) will ship. It is not trained yet; once it is, it
#: becomes the embedded default here and the tiny model stays the suite's model (tests/conftest.py).
DEMO_MODEL_DIR = _ASSETS / "demo-wan"
#: The embedded default model: the model used when none is given (and DISTVIDEO_MODEL is unset).
EMBEDDED_MODEL_DIR = TINY_MODEL_DIR


def _shipped(path: Path, what: str, remedy: str) -> Path:
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"the {what} is missing at {path}; {remedy}")
    return path


def embedded_model_path() -> Path:
    """Path of the embedded default model shipped with the package (for now the tiny random-weight one)."""
    return _shipped(EMBEDDED_MODEL_DIR, "embedded model", "regenerate it with `python scripts/make_embedded_model.py`")


def tiny_model_path() -> Path:
    """Path of the tiny random-weight model shipped with the package (fast; for tests and smoke runs)."""
    return _shipped(TINY_MODEL_DIR, "tiny model", "regenerate it with `python scripts/make_embedded_model.py`")
