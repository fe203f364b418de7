"""Loading a checkpoint's components with the classes model_index.json names (diffusers, transformers), and the
cheap checks of its files (`verify_component_files`) that run before any process starts or weight loads."""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distvideo.errors import ConfigError, ModelLoadError
from distvideo.models.registry import ModelInfo

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_LIBRARIES = ("diffusers", "transformers")


def component_class(library: str, class_name: str) -> Any:
    if library not in _LIBRARIES:
        raise ModelLoadError(f"component library {library!r} is not supported (expected one of {_LIBRARIES})")
    from distvideo.models import compat

    compat.defer_torchao()  # before the first model class: neither library needs torchao (see there)
    module = importlib.import_module(library)
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ModelLoadError(
            f"{library} has no class {class_name!r} (installed {library} {module.__version__})"
        ) from None


def load_component(
    info: ModelInfo, name: str, dtype: torch.dtype | None = None, *, allow_pickle_weights: bool = False
) -> Any:
    """Load one component (e.g. "transformer") from its subfolder with the class model_index.json names."""
    library, class_name = info.index[name]
    cls = component_class(library, class_name)
    folder = info.path / name
    kwargs: dict[str, Any] = {}
    if dtype is not None and name not in _NO_WEIGHTS:
        kwargs["dtype" if library == "transformers" else "torch_dtype"] = dtype
    if name not in _NO_WEIGHTS and not allow_pickle_weights:
        kwargs["use_safetensors"] = True  # never unpickle weights (verify_component_files refused pickle-only ones)
    try:
        if name == "scheduler":
            return cls.from_pretrained(str(info.path), subfolder="scheduler")
        return cls.from_pretrained(str(folder), **kwargs)
    except Exception as exc:
        broken = _component_problem(info.path / name, name)
        raise ModelLoadError(
            f"cannot load the {name} ({library}.{class_name}) from {folder}: {type(exc).__name__}: {exc}. "
            + (f"{broken}; re-download it." if broken else "Check that the folder is complete (re-download it).")
        ) from exc


def _quiet_library_progress() -> None:
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def load_components(
    info: ModelInfo, dtypes: dict[str, torch.dtype], *, allow_pickle_weights: bool = False
) -> dict[str, Any]:
    """Every component of the family, on the CPU, in the dtype given per component."""
    _quiet_library_progress()
    out: dict[str, Any] = {}
    for name in info.family.components:
        out[name] = load_component(info, name, dtypes.get(name), allow_pickle_weights=allow_pickle_weights)
        logger.debug("loaded %s from %s", name, info.path / name)
    return out


# --- file checks before loading -----------------------------------------------------------------------------------
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
# components made of JSON / vocabulary files only
_NO_WEIGHTS = ("tokenizer", "tokenizer_2", "scheduler", "guider", "image_processor", "feature_extractor")


def verify_component_files(info: ModelInfo, *, allow_pickle_weights: bool = False) -> None:
    """Reject a checkpoint folder whose files are missing or visibly corrupt, naming the file (ConfigError), before any
    process starts or weight loads: every weight component has a weight file, every shard its index lists exists,
    every *.safetensors header is readable and covers the file (a truncated download fails here), every JSON file of
    the tokenizer parses. Reads headers only, never the weights. A component whose weights exist only as pickles
    (.bin, .pt, .pth, .ckpt: loading one can run code) is refused unless `allow_pickle_weights`."""
    for name in info.family.components:
        problem = _component_problem(info.path / name, name)
        if problem:
            raise ConfigError(f"--model {info.path}: {problem}; re-download the checkpoint (or that file)")
        if not allow_pickle_weights and name not in _NO_WEIGHTS:
            library, class_name = info.index[name]
            _refuse_pickles(info.path / name, name, f"{library}.{class_name}")
        _refuse_quantized(info.path / name, name)


def _refuse_quantized(folder: Path, name: str) -> None:
    """A component saved already quantized (its config.json has a `quantization_config`: bitsandbytes, GGUF, torchao,
    ...) is refused: distvideo quantizes full-precision weights itself, at load (--quantize)."""
    config = folder / "config.json"
    if name in _NO_WEIGHTS or not config.is_file():
        return
    try:
        quantization = json.loads(config.read_text()).get("quantization_config")
    except (ValueError, OSError, AttributeError):
        return  # _component_problem reports an unreadable file
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else "unknown"
        raise ConfigError(
            f"--model {folder.parent}: the {name} is saved quantized ({config}: quantization_config, quant_method "
            f"{method!r}), a format distvideo does not load; use the full-precision checkpoint and --quantize "
            "int8, int8-weight, fp8 or fp8-weight, which quantizes it at load",
            param="model",
        )


def _refuse_pickles(folder: Path, name: str, cls: str) -> None:
    files = [p.name for p in folder.iterdir() if p.is_file()]
    if any(f.endswith(".safetensors") for f in files):
        return
    pickles = sorted(f for f in files if f.endswith(_WEIGHT_SUFFIXES))
    raise ConfigError(
        f"--model {folder.parent}: the {name} has only pickle weights ({', '.join(pickles)}); loading a pickle can run "
        f"code, so distvideo loads only .safetensors. Convert it once, from a source you trust: "
        f"{cls}.from_pretrained('{folder}').save_pretrained('{folder}', safe_serialization=True); "
        "or pass --allow-pickle-weights (allow_pickle_weights=True) if you trust this file."
    )


def _component_problem(folder: Path, name: str) -> str | None:
    """What is wrong with a component's files, or None when the cheap checks pass."""
    try:
        return _broken_json(folder) if name in _NO_WEIGHTS else _broken_weights(folder)
    except OSError as exc:
        return f"{folder}/ cannot be read ({exc})"


def _broken_weights(folder: Path) -> str | None:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    weights = [p for p in files if p.name.endswith(_WEIGHT_SUFFIXES)]
    for index in (p for p in files if p.name.endswith(".index.json")):
        problem = _broken_json_file(index)
        if problem:
            return problem
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(str(s) for s in shards if not (folder / str(s)).is_file())
        if missing:
            return f"{index} lists shard(s) that are missing: {', '.join(missing)}"
    if not weights:
        return (
            f"{folder}/ has no weight file (expected e.g. diffusion_pytorch_model.safetensors or model.safetensors; "
            f"found {', '.join(p.name for p in files) or 'nothing'})"
        )
    for path in weights:
        problem = _broken_safetensors(path) if path.suffix == ".safetensors" else None
        if problem:
            return problem
    return None


def _broken_safetensors(path: Path) -> str | None:
    """Why `path` is not a complete safetensors file (its header is read, and checked against the file size)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np"):
            return None
    except (SafetensorError, OSError) as exc:
        return f"{path} is corrupt or truncated ({path.stat().st_size} bytes): {exc}"


def _broken_json(folder: Path) -> str | None:
    for path in sorted(folder.glob("*.json")):
        problem = _broken_json_file(path)
        if problem:
            return problem
    return None


def _broken_json_file(path: Path) -> str | None:
    try:
        json.loads(path.read_bytes())
    except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"{path} is not valid JSON ({exc})"
    return None
