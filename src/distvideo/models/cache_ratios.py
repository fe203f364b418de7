"""Step-cache settings of a request, resolved against its model: the method defaults, and MagCache's calibrated
magnitude ratios, which are per model, scheduler and step count and live beside the model in a small JSON file
(`distvideo calibrate` writes it; docs/caching.md)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distvideo.errors import ConfigError
from distvideo.paths import replace_file
from distvideo.request import CACHE_CALIBRATE, ResolvedRequest

RATIOS_FILE = "distvideo_cache_ratios.json"
#: keys a checkpoint's distvideo_defaults.json may set for step caching
CACHE_DEFAULT_KEYS = ("cache", "cache_threshold", "cache_warmup_steps", "cache_max_skip")


@dataclass(frozen=True)
class MethodDefaults:
    """A step-cache method's defaults (one row of METHOD_DEFAULTS per method of pipelines/caching/)."""

    threshold: Callable[[int], float] | None  # by step count; None: the method takes no threshold
    warmup_fraction: float  # of the steps, always computed first (at least 1 step)
    max_skip: int | None  # skips in a row at most; None: no limit
    calibrated: bool = False  # needs `distvideo calibrate`'s ratios for the scheduler and step count


def mag_threshold(steps: int) -> float:
    """MagCache's default threshold follows the step count: 0.006 per step, between diffusers' 0.06 (at 10 steps
    and fewer) and 0.24 (at 40 and more). The finer the steps, the less a reused residual drifts per skip, so the same
    3-skip runs cost less: on the demo model 0.24 at 50 steps and 0.12 at 20 keep every caption (docs/caching.md)."""
    return min(0.24, max(0.06, 0.006 * steps))


METHOD_DEFAULTS: dict[str, MethodDefaults] = {
    "first-block": MethodDefaults(threshold=lambda steps: 0.05, warmup_fraction=0.1, max_skip=None),
    "mag": MethodDefaults(threshold=mag_threshold, warmup_fraction=0.2, max_skip=3, calibrated=True),
    # diffusers' TaylorSeerCacheConfig: cache_interval 5 (4 forecast steps after each computed one)
    "taylorseer": MethodDefaults(threshold=None, warmup_fraction=0.1, max_skip=4),
}
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
    request: ResolvedRequest, ratios: dict[str, list[float]], scheduler: str, model: Path
) -> ResolvedRequest:
    """Fill the cache fields of a request whose other fields are resolved from the method's METHOD_DEFAULTS row:
    method "none" when unset, the threshold (for the step count), warmup and skips in a row; a calibrated method
    needs ratios for this scheduler and step count; a method without a threshold refuses one."""
    method, steps = request.cache, request.num_inference_steps
    if method == "none" or method == CACHE_CALIBRATE:
        return dataclasses.replace(request, cache=method)
    n, defaults = request.naming, METHOD_DEFAULTS[method]
    if defaults.calibrated and ratios_key(scheduler, steps) not in ratios:
        raise ConfigError(_uncalibrated(request, ratios, scheduler, model), param="cache")
    if steps < MIN_CACHE_STEPS:
        raise ConfigError(
            f"{n.subject('cache', method)}: {n.subject('num_inference_steps', steps)} is a few-step schedule, where "
            "each step moves the latents too far for the next one to reuse it: a step cache would compute every step "
            f"anyway (it needs at least {MIN_CACHE_STEPS}); drop {n.label('cache')}: the step count is the speedup",
            param="cache",
        )
    if defaults.threshold is None and request.cache_threshold is not None:
        raise ConfigError(
            f"{n.subject('cache_threshold', request.cache_threshold)}: {n.setting('cache', method)} skips on a fixed "
            f"schedule and takes no threshold; drop it, and set {n.label('cache_max_skip')} (the skipped steps after "
            "each computed one) instead",
            param="cache_threshold",
        )
    threshold = defaults.threshold(steps) if defaults.threshold is not None else None
    return dataclasses.replace(
        request,
        cache=method,
        cache_threshold=threshold if request.cache_threshold is None else request.cache_threshold,
        cache_warmup_steps=(
            max(1, round(defaults.warmup_fraction * steps))
            if request.cache_warmup_steps is None
            else request.cache_warmup_steps
        ),
        cache_max_skip=((defaults.max_skip or steps) if request.cache_max_skip is None else request.cache_max_skip),
    )


def check_cache_servable(request: ResolvedRequest, *, compiled: bool) -> None:
    """A cached request on an engine whose blocks are compiled (--compile): refused, as the engine has no step-cache
    hooks there (the compiled blocks would trace the per-step decisions)."""
    if compiled and request.cache not in (None, "none"):
        raise compile_refusal(request)


def compile_refusal(request: ResolvedRequest) -> ConfigError:
    """The error for a cached request on an engine that compiles its blocks."""
    n = request.naming
    return ConfigError(
        f"{n.subject('cache', request.cache)}: step caching is not served with --compile (the compiled blocks would "
        f"trace the cache's per-step decisions); drop {n.label('cache')} or start the engine without --compile",
        param="cache",
    )


def _uncalibrated(request: ResolvedRequest, ratios: dict[str, list[float]], scheduler: str, model: Path) -> str:
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
