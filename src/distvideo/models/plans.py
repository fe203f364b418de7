"""The one contract for changing a loaded module in place: a plan names the component it changes, and `apply`
returns the function that undoes it.

Speed plans (exact reformulations, :func:`speed_plans`) come from the engine config; parallel plans (Ulysses, the
text-projection memo, the banded VAE decode) from the parallel context. The worker applies both, once, with
:func:`apply_plans`, right after loading; nothing else patches a module.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from distvideo.config import EngineConfig
from distvideo.models import compat
from distvideo.models.registry import ModelInfo

logger = logging.getLogger(__name__)

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


@dataclass
class CompilePlan:
    """Regional compilation: ``torch.compile`` of each repeated block of a diffusers transformer (its
    ``_repeated_blocks``, WanTransformerBlock for Wan), through diffusers' ``compile_repeated_blocks``. The blocks share
    one compiled graph, so a shape compiles once, not once per layer. Listed after every plan that replaces attention
    processors, so the compiled blocks trace the final processors. Compilation itself happens at the first call of
    each new shape; `dynamic=False`: every shape gets its own static graph (no second, dynamic-shape recompile)."""

    component: str
    dynamic: bool | None = False

    def apply(self, module: nn.Module) -> Undo:
        compile_blocks = getattr(module, "compile_repeated_blocks", None)
        if compile_blocks is None:
            raise TypeError(f"{self.component} ({type(module).__name__}) has no compile_repeated_blocks (diffusers)")
        compile_blocks(dynamic=self.dynamic)
        compiled = compat.compiled_modules(module)

        def undo() -> None:
            for block in compiled:
                compat.uncompile(block)

        return undo


def speed_plans(config: EngineConfig, model: ModelInfo | None = None, *, sp_size: int = 1) -> list[ModulePlan]:
    """The exact speed plans the config turns on (its switches resolved: EngineConfig.with_defaults), for every
    denoising transformer of the model's family (Wan2.1 T2V's one when `model` is None). A plan not shown exact for
    a family is left out of its list, with the reason logged once; so is `--compile` under sequence parallelism
    (`sp_size` > 1), which it does not yet serve."""
    from distvideo.models.text_padding import TextPaddingPlan

    transformers = model.family.transformers if model is not None else ("transformer",)
    plans: list[ModulePlan] = []
    if config.compact_text_padding:
        if model is not None and model.family.image_encoder:
            _log_once(
                f"compact text padding is off for {model.family.name}: its cross-attention attends to CLIP image "
                "tokens in front of the text, which the plan's processor does not handle (it compacts text-only "
                "cross-attention)"
            )
        else:
            plans += [TextPaddingPlan(component=name) for name in transformers]
    if config.cpu_kernels:
        plans += [CpuKernelsPlan("vae"), *(CpuKernelsPlan(name) for name in transformers)]
    compiling = bool(config.compile)
    if compiling and sp_size > 1:
        compiling = False
        _log_once(
            f"--compile is off under sequence parallelism (sp_size={sp_size}): Ulysses' per-block hooks made the "
            "compiled blocks recompile until torch's limit of 8 graphs and then run eagerly"
        )
    if compiling:  # last: after every plan that replaces attention processors or module methods
        if any(isinstance(plan, TextPaddingPlan) for plan in plans):
            _log_once(
                "compact text padding is off with --compile: the compacted text follows each prompt's token count, "
                "so the compiled blocks would compile again for each new prompt length (torch keeps 8 graphs, then "
                "runs them eagerly); with the full padded text there is one graph per video shape"
            )
            plans = [plan for plan in plans if not isinstance(plan, TextPaddingPlan)]
        plans += [CompilePlan(name) for name in transformers]
    return plans


@functools.cache
def _log_once(message: str) -> None:
    logger.info("%s", message)


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
