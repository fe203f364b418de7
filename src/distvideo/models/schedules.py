"""The noise schedule of a request: which of diffusers' flow-matching schedulers runs it, with which shift and which
sigmas (docs/performance.md, "Few-step models").

Resolved from names and the checkpoint's `scheduler/scheduler_config.json` alone (no diffusers import: the driver
checks a request before any rank starts); the pipelines build the scheduler from the result
(pipelines/schedules.py). With no schedule option the checkpoint's scheduler runs exactly as its config says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from distvideo.errors import ConfigError
from distvideo.request import GenerationRequest, ResolvedRequest

#: --scheduler's names -> diffusers' classes (the flow-matching ones every Wan-style checkpoint can run)
SCHEDULER_CLASSES = {
    "unipc": "UniPCMultistepScheduler",
    "euler": "FlowMatchEulerDiscreteScheduler",
    "dpm": "DPMSolverMultistepScheduler",
}
_EULER, _UNIPC, _DPM = (SCHEDULER_CLASSES[k] for k in ("euler", "unipc", "dpm"))
#: request fields that say the schedule (a checkpoint's distvideo_defaults.json may set them too)
SCHEDULE_KEYS = ("scheduler", "flow_shift", "timesteps", "sigmas")


@dataclass(frozen=True)
class Schedule:
    """`class_name` built `from_config(config)`; `sigmas`: an explicit list before the flow shift (the scheduler
    shifts it), None for the scheduler's own spacing (or the family's: HunyuanVideo 1.5 passes its linear sigmas)."""

    class_name: str
    config: dict[str, Any]
    sigmas: tuple[float, ...] | None = None
    default: bool = True  # the checkpoint's scheduler as its config says it, at its own spacing

    def key(self) -> str:
        """Names this schedule in a MagCache ratios file: the class for the checkpoint's own schedule (as files
        written before schedules were options have it), with the shift and the sigmas for any other."""
        if self.default:
            return self.class_name
        shift = self.config.get("shift" if self.class_name == _EULER else "flow_shift")
        sigmas = "" if self.sigmas is None else " sigmas=" + ",".join(f"{s:g}" for s in self.sigmas)
        return f"{self.class_name} shift={shift}{sigmas}"


def fill_schedule(request: GenerationRequest, defaults: dict[str, Any]) -> tuple[GenerationRequest, dict[str, Any]]:
    """The steps an explicit list sets, and the model's defaults less a declared list the request overrides: a list
    of the request's own, a step count the checkpoint's list does not have, or the DPM-Solver, which takes no list
    (the scheduler then spaces the steps itself, with the declared shift)."""
    defaults = dict(defaults)
    given = request.timesteps if request.timesteps is not None else request.sigmas
    if given is not None and request.num_inference_steps is None:
        request = dataclasses.replace(request, num_inference_steps=len(given))
    steps = request.num_inference_steps
    declared = defaults.get("timesteps") or defaults.get("sigmas")
    other_count = steps is not None and declared is not None and len(declared) != steps
    if given is not None or other_count or request.scheduler == "dpm":  # DPM-Solver takes no list: its own spacing
        defaults = {k: v for k, v in defaults.items() if k not in ("timesteps", "sigmas")}
    return request, defaults


def schedule_for(request: ResolvedRequest, checkpoint: dict[str, Any]) -> Schedule:
    """The schedule of a resolved request, against the checkpoint's
    scheduler config; ConfigError naming the option where that scheduler cannot take it."""
    n = request.naming
    base = str(checkpoint.get("_class_name", ""))
    name = request.scheduler or "default"
    cls = base if name == "default" else SCHEDULER_CLASSES[name]
    train = int(checkpoint.get("num_train_timesteps", 1000))
    if cls == base:
        config = dict(checkpoint)
    else:  # another class: the checkpoint's training timesteps and shift carried over, flow prediction
        config = {"num_train_timesteps": train}
        if cls != _EULER:
            config.update(prediction_type="flow_prediction", use_flow_sigmas=True)
        config[_shift_key(cls)] = _checkpoint_shift(checkpoint)
    if request.flow_shift is not None:
        if cls not in SCHEDULER_CLASSES.values():
            raise ConfigError(
                f"{n.label('flow_shift')}: the checkpoint's scheduler {base} has no flow shift; pick a flow-matching "
                f"one with {n.label('scheduler')} ({', '.join(SCHEDULER_CLASSES)})",
                param="flow_shift",
            )
        config[_shift_key(cls)] = float(request.flow_shift)
    sigmas = _explicit_sigmas(request, train)
    if sigmas is not None:
        _check_takes_sigmas(request, cls, config)
    default = name == "default" and request.flow_shift is None and sigmas is None
    return Schedule(cls, config, sigmas, default)


def _explicit_sigmas(request: ResolvedRequest, train: int) -> tuple[float, ...] | None:
    if request.sigmas is not None:
        return tuple(float(s) for s in request.sigmas)
    if request.timesteps is None:
        return None
    if max(request.timesteps) > train:
        n = request.naming
        raise ConfigError(
            f"{n.subject('timesteps', request.timesteps)}: the scheduler is trained on timesteps up to {train}; give "
            f"values above 0 and at most {train}",
            param="timesteps",
        )
    return tuple(float(t) / train for t in request.timesteps)


def _check_takes_sigmas(request: ResolvedRequest, cls: str, config: dict[str, Any]) -> None:
    """An explicit list runs on Euler, or UniPC with flow sigmas (diffusers' DPM-Solver takes no flow list)."""
    if cls == _EULER or (cls == _UNIPC and config.get("use_flow_sigmas")):
        return
    n = request.naming
    which = "timesteps" if request.timesteps is not None else "sigmas"
    raise ConfigError(
        f"{n.label(which)}: {cls} takes no explicit list of flow sigmas; run it with "
        f"{n.setting('scheduler', 'euler')} (or unipc), or drop {n.label(which)}",
        param=which,
    )


def _shift_key(cls: str) -> str:
    return "shift" if cls == _EULER else "flow_shift"


def _checkpoint_shift(checkpoint: dict[str, Any]) -> float:
    for key in ("flow_shift", "shift"):
        value = checkpoint.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 1.0
