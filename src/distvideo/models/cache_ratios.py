"""Step-cache settings of a request, resolved against its model: the method defaults, and MagCache's calibrated
magnitude ratios, which are per model, scheduler and step count and live beside the model in a small JSON file
(`distvideo calibrate` writes it; docs/caching.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from distvideo.errors import ConfigError
from distvideo.paths import replace_file
from distvideo.request import CACHE_CALIBRATE, GenerationRequest

RATIOS_FILE = "distvideo_cache_ratios.json"
#: keys a checkpoint's distvideo_defaults.json may set for step caching
CACHE_DEFAULT_KEYS = ("cache", "cache_threshold", "cache_warmup_steps", "cache_max_skip")
#: per method: threshold, and the fraction of the steps that are always computed first (warmup)
METHOD_DEFAULTS: dict[str, tuple[float, float]] = {"first-block": (0.05, 0.1), "mag": (0.06, 0.2)}
MAG_MAX_SKIP = 3
#: below this many steps a step cache is refused: each step of a few-step schedule moves the latents too far for the
#: next to reuse it (the demo model skipped no step at 4 or 8 steps, even at 4x first-block's default threshold)
MIN_CACHE_STEPS = 5


def ratios_key(scheduler: str, steps: int) -> str:
    return f"{scheduler}/{steps}"


def scheduler_name(index: dict[str, Any]) -> str:
    entry = index.get("scheduler")
    return str(entry[1]) if isinstance(entry, list) and len(entry) == 2 else "unknown"


def read_ratios(root: Path) -> dict[str, list[float]]:
    """{"<scheduler>/<steps>": ratios} from the model folder's ratios file ({} without one)."""
    path = root / RATIOS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        ratios = data["ratios"]
        return {str(k): [float(x) for x in v] for k, v in ratios.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a step-cache ratios file ({exc}); run `distvideo calibrate` again") from None


def write_ratios(root: Path, scheduler: str, steps: int, ratios: list[float]) -> Path:
    """Add (or replace) the ratios of `steps` steps in the model folder's ratios file, atomically."""
    path = root / RATIOS_FILE
    known = read_ratios(root)
    known[ratios_key(scheduler, steps)] = [round(float(r), 6) for r in ratios]
    replace_file(path, json.dumps({"version": 1, "ratios": dict(sorted(known.items()))}, indent=1) + "\n")
    return path


def resolve_cache(
    request: GenerationRequest, ratios: dict[str, list[float]], scheduler: str, model: Path
) -> GenerationRequest:
    """Fill the cache fields of a request whose other fields are resolved: method "none" when unset, the method's
    threshold and warmup, at most MAG_MAX_SKIP consecutive skips for mag (no limit for first-block); mag needs
    calibrated ratios for this scheduler and step count."""
    method = request.cache or "none"
    steps = request.num_inference_steps
    assert steps is not None
    if method == "none" or method == CACHE_CALIBRATE:
        return dataclasses.replace(request, cache=method)
    threshold, warmup_fraction = METHOD_DEFAULTS[method]
    if method == "mag" and ratios_key(scheduler, steps) not in ratios:
        raise ConfigError(_uncalibrated(request, ratios, scheduler, model), param="cache")
    if steps < MIN_CACHE_STEPS:
        n = request.naming
        raise ConfigError(
            f"{n.subject('cache', method)}: {n.subject('num_inference_steps', steps)} is a few-step schedule, where "
            "each step moves the latents too far for the next one to reuse it: a step cache would compute every step "
            f"anyway (it needs at least {MIN_CACHE_STEPS}); drop {n.label('cache')}: the step count is the speedup",
            param="cache",
        )
    return dataclasses.replace(
        request,
        cache=method,
        cache_threshold=threshold if request.cache_threshold is None else request.cache_threshold,
        cache_warmup_steps=(
            max(1, round(warmup_fraction * steps)) if request.cache_warmup_steps is None else request.cache_warmup_steps
        ),
        cache_max_skip=(
            (MAG_MAX_SKIP if method == "mag" else steps) if request.cache_max_skip is None else request.cache_max_skip
        ),
    )


def _uncalibrated(request: GenerationRequest, ratios: dict[str, list[float]], scheduler: str, model: Path) -> str:
    """Why mag cannot run this step count, and what would: the calibrated step counts, first-block, or calibrating.
    A client of the service is told to ask its operator, and is shown no path of the server's."""
    n, steps = request.naming, request.num_inference_steps
    known = sorted(int(k.split("/")[1]) for k in ratios if k.startswith(f"{scheduler}/"))
    if n.style == "json":
        who, calibrate = (
            "the served model",
            f"the server's operator can add them with `distvideo calibrate --steps {steps}`",
        )
    else:
        who, calibrate = model.name, f"run `distvideo calibrate --model {model} --steps {steps}`"
    other_steps = f" or {n.setting('num_inference_steps', known[0])}" if known else ""
    return (
        f"{n.subject('cache', 'mag')}: {who} has no MagCache ratios for {steps} steps with {scheduler} (calibrated step "
        f"counts: {known or 'none'}); {calibrate}; or use {n.setting('cache', 'first-block')}{other_steps}"
    )
