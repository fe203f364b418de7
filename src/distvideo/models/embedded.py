"""The embedded tiny model: a complete diffusers-format checkpoint shipped as package data, the default model."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-wan"


def embedded_model_path() -> Path:
    """Path of the embedded tiny model folder shipped with the package."""
    if not (EMBEDDED_MODEL_DIR / "model_index.json").is_file():
        raise FileNotFoundError(
            f"the embedded tiny model is missing at {EMBEDDED_MODEL_DIR}; "
            "regenerate it with `python scripts/make_embedded_model.py`"
        )
    return EMBEDDED_MODEL_DIR
