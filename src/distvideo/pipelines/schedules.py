"""A fresh scheduler per request, built from the request's schedule (models/schedules.py, resolved from the
checkpoint's scheduler config as `ModelInfo.schedule` reads it): the checkpoint's own scheduler and spacing unless
the request (or the checkpoint's distvideo_defaults.json) names another scheduler, a flow shift or an explicit list."""

from __future__ import annotations

from typing import Any

import diffusers
import numpy as np
import torch

from distvideo.models.registry import ModelInfo
from distvideo.models.schedules import SCHEDULER_CLASSES
from distvideo.request import ResolvedRequest


def request_scheduler(
    model: ModelInfo, request: ResolvedRequest, device: torch.device, *, linear_sigmas: bool = False
) -> Any:
    """`linear_sigmas`: the family spaces its steps by sigmas 1 ... 1/steps (HunyuanVideo 1.5, as its diffusers
    pipeline) where the request gives no list; a multistep DPM-Solver spaces its own."""
    schedule = model.schedule(request)
    scheduler = getattr(diffusers, schedule.class_name).from_config(schedule.config)
    steps = request.num_inference_steps
    sigmas: Any = schedule.sigmas
    if sigmas is None and linear_sigmas and schedule.class_name != SCHEDULER_CLASSES["dpm"]:
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
    if sigmas is None:
        scheduler.set_timesteps(steps, device=device)
    else:
        scheduler.set_timesteps(sigmas=np.asarray(sigmas, dtype=np.float64), device=device)  # UniPC shifts no list
    scheduler.set_begin_index(0)
    return scheduler
