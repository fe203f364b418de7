"""Loading a checkpoint's components with the classes model_index.json names (diffusers, transformers)."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from distvideo.models.registry import ModelInfo

logger = logging.getLogger(__name__)

_LIBRARIES = ("diffusers", "transformers")


class ModelLoadError(RuntimeError):
    """A component of a checkpoint could not be loaded (missing or corrupt weights, bad tokenizer)."""


def component_class(library: str, class_name: str) -> Any:
    if library not in _LIBRARIES:
        raise ModelLoadError(f"component library {library!r} is not supported (expected one of {_LIBRARIES})")
    module = importlib.import_module(library)
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ModelLoadError(
            f"{library} has no class {class_name!r} (installed {library} {module.__version__})"
        ) from None


def load_component(info: ModelInfo, name: str, dtype: torch.dtype | None = None) -> Any:
    """Load one component (e.g. "transformer") from its subfolder with the class model_index.json names."""
    library, class_name = info.index[name]
    cls = component_class(library, class_name)
    folder = info.path / name
    kwargs: dict[str, Any] = {}
    if dtype is not None and name not in ("tokenizer", "scheduler"):
        kwargs["dtype" if library == "transformers" else "torch_dtype"] = dtype
    try:
        if name == "scheduler":
            return cls.from_pretrained(str(info.path), subfolder="scheduler")
        return cls.from_pretrained(str(folder), **kwargs)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load the {name} ({library}.{class_name}) from {folder}: {type(exc).__name__}: {exc}. "
            "Check that the folder is complete (re-download missing or corrupt *.safetensors files)."
        ) from exc


def _quiet_library_progress() -> None:
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def load_components(info: ModelInfo, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Every component of the family, on the CPU, in the dtype given per component."""
    _quiet_library_progress()
    out: dict[str, Any] = {}
    for name in info.family.components:
        out[name] = load_component(info, name, dtypes.get(name))
        logger.debug("loaded %s from %s", name, info.path / name)
    return out
