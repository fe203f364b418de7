"""The models shipped as package data: the embedded default (the trained demo model) and the tiny random one."""

from __future__ import annotations

import re
from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets"

#: The tiny random-weight model (draws noise): the test suite's fast model, rebuilt byte for byte by
#: ``scripts/make_embedded_model.py``.
TINY_MODEL_DIR = _ASSETS / "tiny-wan"
#: The demo model: a small Wan2.1-architecture model trained on moving shapes (docs/demo-model.md), made by
#: ``scripts/train_demo_model.py``. It is the embedded default; the suite keeps the tiny model (tests/conftest.py).
DEMO_MODEL_DIR = _ASSETS / "demo-wan"
#: The demo model distilled to 4 steps without guidance (docs/demo-model.md, "The 4-step model"), made by
#: ``scripts/distill_demo_model.py``: its distvideo_defaults.json declares the schedule.
DEMO_4STEP_MODEL_DIR = _ASSETS / "demo-wan-4step"
#: The embedded default model: the model used when none is given (and DISTVIDEO_MODEL is unset).
EMBEDDED_MODEL_DIR = DEMO_MODEL_DIR
#: Names `--model` takes for the shipped models (a folder of that name, when there is one, wins)
SHIPPED_MODELS = {"demo": DEMO_MODEL_DIR, "demo-4step": DEMO_4STEP_MODEL_DIR}
#: A caption of the demo model's grammar (docs/demo-model.md): colour, shape, direction, background
DEMO_EXAMPLE_PROMPT = "a red ball moving right on a black background"
#: What a page suggests for any other model (a scene, not the demo's grammar)
GENERIC_EXAMPLE_PROMPT = "a red fox running through fresh snow at dawn"
IMAGE_EXAMPLE_PROMPT = "the scene in the image comes to life, the camera slowly pushing in"


def example_prompt(model_dir: Path, takes_image: bool) -> str:
    """A prompt that fits the model at `model_dir`: the demo model's grammar for the demo model (other words give
    it an arbitrary blob), a description of motion for an image-to-video model, else a scene."""
    if _is_demo(model_dir):
        return DEMO_EXAMPLE_PROMPT
    return IMAGE_EXAMPLE_PROMPT if takes_image else GENERIC_EXAMPLE_PROMPT


#: The demo model's caption grammar, word lists in order (docs/demo-model.md); distvideo.testing.shapes renders clips
#: of it with a colour for each word (tests/test_shapes_dataset.py checks that the two agree).
DEMO_GRAMMAR = {
    "color": ("red", "green", "blue", "yellow", "white"),
    "shape": ("ball", "square", "triangle"),
    "direction": ("left", "right", "up", "down"),
    "background": ("black", "gray", "white"),
}
DEMO_CAPTION = re.compile(r"^a (\w+) (\w+) moving (\w+) on a (\w+) background$")


def demo_grammar() -> str:
    """The demo model's caption grammar, as a person reads it."""
    c, s, d, b = ("{" + "|".join(words) + "}" for words in DEMO_GRAMMAR.values())
    return f"a {c} {s} moving {d} on a {b} background"


def prompt_warning(model_dir: Path, prompt: str) -> str | None:
    """A warning for a prompt the model cannot draw: the demo model knows only its grammar (it draws an arbitrary blob
    for anything else, and nothing visible for a shape of the background's colour); None for a caption of it, and for
    every other model."""
    if not _is_demo(model_dir):
        return None
    match = DEMO_CAPTION.match(prompt.strip())
    if match:
        words = match.groups()
        if all(w in allowed for w, allowed in zip(words, DEMO_GRAMMAR.values(), strict=True)) and words[0] != words[3]:
            return None
    return (
        f"the demo model knows only captions of its grammar, '{demo_grammar()}' (docs/demo-model.md; the shape's "
        f"colour is not the background's), and draws an arbitrary blob for the prompt {prompt[:80]!r}; try "
        f"{DEMO_EXAMPLE_PROMPT!r}, or use a real checkpoint (--model) for other prompts"
    )


def _is_demo(model_dir: Path) -> bool:
    """The demo model or its 4-step student: the same grammar."""
    return model_dir.resolve() in (DEMO_MODEL_DIR.resolve(), DEMO_4STEP_MODEL_DIR.resolve())


def packaged_model(path: Path) -> bool:
    """Whether `path` is one of the models shipped inside the installed package (its files are the package's)."""
    return path.resolve().parent == _ASSETS


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
