"""The one contract for changing a loaded module in place: a plan has a stable `name`, names the component it
changes, and `apply` returns the function that undoes it.

Speed plans (exact reformulations, :func:`speed_plans`) come from the engine config; parallel plans (Ulysses, the
text-projection memo, the banded VAE decode) from the parallel context. The worker applies both, once, with
:func:`apply_plans`, right after loading; nothing else patches a module.

Applied plans are named on the module they changed, as diffusers' ``HookRegistry`` names its hooks: a
:class:`PlanRegistry` on the module lists them in order (:func:`applied_plans`) and removes one by name
(:func:`remove_plan`), undoing that one only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from torch import nn

from distvideo.config import EngineConfig
from distvideo.models import compat
from distvideo.models.family import declared
from distvideo.models.registry import ModelInfo

logger = logging.getLogger(__name__)

Undo = Callable[[], None]


class ModulePlan(Protocol):
    """Changes one component (`component`: "transformer", "vae", ...) in place; `apply` returns the undo. `name`
    ("ulysses", "compile", ...) is the plan's stable name on the module, unique there. `apply` refuses what it cannot
    do before it changes anything, so a plan that raises leaves its module as it was."""

    component: str

    @property
    def name(self) -> str: ...

    def apply(self, module: nn.Module) -> Undo: ...


@dataclass
class CpuKernelsPlan:
    """oneDNN 3D convolutions and fast channel RMS norms on CPU (models/cpu_kernels.py); GPU calls are untouched."""

    component: str
    name: ClassVar[str] = "cpu-kernels"

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
    name: ClassVar[str] = "compile"

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


def speed_plans(config: EngineConfig, model: ModelInfo, *, sp_size: int = 1) -> list[ModulePlan]:
    """The exact speed plans the config turns on (its switches resolved: EngineConfig.with_defaults), for every
    denoising transformer of the model's family: the family's compact-text plan where it declares one, the CPU
    kernels, compile. A plan not shown exact for a family is left out of its list, with the reason logged once; so
    is `--compile` under sequence parallelism (`sp_size` > 1), which it does not yet serve."""
    family = model.family
    transformers = family.transformers
    plans: list[ModulePlan] = []
    text_plan = None
    if config.compact_text_padding:
        if family.compact_text is None:
            _log_once(f"compact text padding is off for {family.name}: {family.compact_text_off}")
        else:
            text_plan = declared(family.compact_text)
            plans += [text_plan(component=name) for name in transformers]
    if config.cpu_kernels:
        plans += [CpuKernelsPlan("vae"), *(CpuKernelsPlan(name) for name in transformers)]
    compiling = compiles_blocks(config, sp_size)
    if config.compile and not compiling:
        _log_once(
            f"--compile is off under sequence parallelism (sp_size={sp_size}): Ulysses' per-block hooks made the "
            "compiled blocks recompile until torch's limit of 8 graphs and then run eagerly"
        )
    if compiling:  # last: after every plan that replaces attention processors or module methods
        if text_plan is not None:
            _log_once(
                "compact text padding is off with --compile: the compacted text follows each prompt's token count, "
                "so the compiled blocks would compile again for each new prompt length (torch keeps 8 graphs, then "
                "runs them eagerly); with the full padded text there is one graph per video shape"
            )
            plans = [plan for plan in plans if not isinstance(plan, text_plan)]
        plans += [CompilePlan(name) for name in transformers]
    return plans


def compiles_blocks(config: EngineConfig, sp_size: int) -> bool:
    """Whether the engine's transformer blocks are compiled: --compile, but not under sequence parallelism."""
    return bool(config.compile) and sp_size == 1


@functools.cache
def _log_once(message: str) -> None:
    logger.info("%s", message)


# --- applied plans, by name ----------------------------------------------------------------------------------------
@dataclass
class AppliedPlan:
    plan: ModulePlan
    undo: Undo


class PlanRegistry:
    """The plans applied to one module, in the order applied: diffusers' ``HookRegistry`` for plans (it lives on the
    module, `check_if_exists_or_initialize` finds or creates it, a name is registered once, removal is by name).

    Only the last plan on a module can be removed. An undo restores what its plan found (the processors, the
    forwards it replaced), so undoing an earlier plan under a later one would put back a processor the later plan
    wrapped, or leave the later plan's undo restoring the earlier plan's changes: out of order, `remove` refuses,
    naming the plans to remove first. The registry holds no reference to its module (no cycle keeps a module's
    weights alive past its last plan)."""

    ATTRIBUTE = "_distvideo_plans"

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the module's class name, for messages
        self._applied: dict[str, AppliedPlan] = {}  # in application order

    @classmethod
    def check_if_exists_or_initialize(cls, module: nn.Module) -> PlanRegistry:
        registry = cls.of(module)
        if registry is None:
            registry = cls(type(module).__name__)
            setattr(module, cls.ATTRIBUTE, registry)  # an attribute, not a submodule: state_dict is unchanged
        return registry

    @classmethod
    def of(cls, module: nn.Module) -> PlanRegistry | None:
        registry = vars(module).get(cls.ATTRIBUTE)
        return registry if isinstance(registry, cls) else None

    def names(self) -> list[str]:
        return list(self._applied)

    def get_plan(self, name: str) -> ModulePlan | None:
        applied = self._applied.get(name)
        return applied.plan if applied is not None else None

    def register_plan(self, module: nn.Module, plan: ModulePlan) -> None:
        """Apply `plan` to `module` (this registry's module) and record it; a name already applied is refused
        before anything changes."""
        if plan.name in self._applied:
            raise ValueError(
                f"plan {plan.name!r} is already applied to {plan.component} ({self.owner}; its plans: "
                f"{self.names()}); remove it first (remove_plan) to apply it again"
            )
        self._applied[plan.name] = AppliedPlan(plan, plan.apply(module))

    def remove_plan(self, name: str) -> None:
        """Undo the plan `name`, which must be the last one applied (see the class docstring)."""
        names = self.names()
        if name not in self._applied:
            raise ValueError(f"no plan {name!r} is applied to {self.owner}; its plans: {names}")
        later = names[names.index(name) + 1 :]
        if later:
            raise ValueError(
                f"plan {name!r} on {self.owner} has {later} applied after it, whose undo assumes it is still there; "
                f"remove those first, last first ({list(reversed(later))})"
            )
        self._applied.pop(name).undo()  # unregistered first: an undo that fails is not run twice

    def __repr__(self) -> str:
        return f"PlanRegistry({self.owner}: {self.names()})"


def apply_plan(module: nn.Module, plan: ModulePlan) -> None:
    """Apply `plan` to `module` under its name (refused when that name is already on the module)."""
    PlanRegistry.check_if_exists_or_initialize(module).register_plan(module, plan)


def applied_plans(module: nn.Module) -> list[str]:
    """The names of the plans applied to `module`, in the order applied."""
    registry = PlanRegistry.of(module)
    return registry.names() if registry is not None else []


def get_plan(module: nn.Module, name: str) -> ModulePlan | None:
    registry = PlanRegistry.of(module)
    return registry.get_plan(name) if registry is not None else None


def remove_plan(module: nn.Module, name: str) -> None:
    """Undo the plan `name` on `module`, which must be its last plan (PlanRegistry)."""
    registry = PlanRegistry.of(module)
    if registry is None:
        raise ValueError(f"no plan {name!r} is applied to {type(module).__name__}; it has no plans")
    registry.remove_plan(name)


class AppliedPlans:
    """What :func:`apply_plans` applied: calling it removes those plans, last first, and with each one the plans
    applied on top of it later (they rely on it, and a plan under another cannot be removed alone), so the modules are
    as loaded again; `names()` reads every component's plans from its module (later ones included)."""

    def __init__(self, components: dict[str, Any], applied: list[tuple[str, str]]) -> None:
        self._components = components
        self._applied = applied  # (component, plan name), in application order

    def record(self, component: str, name: str) -> None:
        self._applied.append((component, name))

    def names(self) -> dict[str, list[str]]:
        """{component: its plans' names in order} for every component with at least one plan."""
        out = {}
        for component, module in self._components.items():
            names = applied_plans(module) if isinstance(module, nn.Module) else []
            if names:
                out[component] = names
        return out

    def __call__(self) -> None:
        while self._applied:
            component, name = self._applied.pop()
            module = self._components[component]
            names = applied_plans(module)
            if name in names:  # not already removed by name
                for above in reversed(names[names.index(name) :]):
                    remove_plan(module, above)


def apply_plans(components: dict[str, Any], plans: Sequence[ModulePlan]) -> AppliedPlans:
    """Apply `plans` in order, each named on its component's module; on failure remove what was applied and raise.
    Returns what was applied: calling it removes them all."""
    compat.check_private_names()
    applied = AppliedPlans(components, [])
    try:
        for plan in plans:
            apply_plan(components[plan.component], plan)
            applied.record(plan.component, plan.name)
    except BaseException:
        applied()
        raise
    return applied
