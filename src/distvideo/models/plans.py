"""The one contract for changing a loaded module in place: a plan names the component it changes, and `apply`
returns the function that undoes it.

Speed plans (exact reformulations, :func:`speed_plans`) come from the engine config; parallel plans (Ulysses, the
text-projection memo, the banded VAE decode) from the parallel context. The worker applies both, once, with
:func:`apply_plans`, right after loading; nothing else patches a module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from distvideo.config import EngineConfig
from distvideo.models import compat

Undo = Callable[[], None]


class ModulePlan(Protocol):
    """Changes one component (`component`: "transformer", "vae", ...) in place; `apply` returns the undo."""

    component: str

    def apply(self, module: nn.Module) -> Undo: ...


@dataclass
class CpuKernelsPlan:
    """oneDNN 3D convolutions and fast channel RMS norms on CPU (models/cpu_kernels.py); GPU calls are untouched."""

    component: str

    def apply(self, module: nn.Module) -> Undo:
        from distvideo.models.cpu_kernels import use_cpu_kernels

        return use_cpu_kernels(module)


def speed_plans(config: EngineConfig) -> list[ModulePlan]:
    """The exact speed plans the config turns on (its switches resolved: EngineConfig.with_defaults)."""
    from distvideo.models.text_padding import TextPaddingPlan

    plans: list[ModulePlan] = []
    if config.compact_text_padding:
        plans.append(TextPaddingPlan())
    if config.cpu_kernels:
        plans += [CpuKernelsPlan("vae"), CpuKernelsPlan("transformer")]
    return plans


def apply_plans(components: dict[str, Any], plans: Sequence[ModulePlan]) -> Undo:
    """Apply `plans` in order; on failure undo what was applied and raise. Returns the undo of all of them."""
    compat.check_private_names()
    undo: list[Undo] = []

    def undo_all() -> None:
        while undo:
            undo.pop()()

    try:
        for plan in plans:
            undo.append(plan.apply(components[plan.component]))
    except BaseException:
        undo_all()
        raise
    return undo_all
