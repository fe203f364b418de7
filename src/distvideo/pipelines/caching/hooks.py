"""The step cache's hooks on a transformer's blocks: diffusers' ``HookRegistry`` and ``ModelHook`` (one hook per
block, named "step-cache"), installed by :class:`StepCachePlan`, which the worker applies with the other plans at load
(models/plans.py) wherever the family declares its cache points and the blocks are not compiled.

With no session in the slot a hook only calls its block (frames byte-identical to no plan). With one, the step's
decision is made at block 0 (before it, or from its residual: session.py), a skipped step's middle blocks hand their
input on, and the last block adds what the method replays; a computed step's last block gives the method the
residual of the cached blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from distvideo.models import compat
from distvideo.models.family import CachePoints
from distvideo.pipelines.caching.session import CacheSession

compat.defer_torchao()  # before diffusers.hooks, which would import torchao (see there)
from diffusers.hooks import HookRegistry, ModelHook  # noqa: E402

HOOK_NAME = "step-cache"


@dataclass
class CacheSlot:
    """Where the pipeline puts the running request's session; every block hook of the plan reads it (None: off)."""

    session: CacheSession | None = None


class _BlockHook(ModelHook):
    """Block `index` of `last + 1` of `transformer` (identified at the step's first call: an expert switch)."""

    def __init__(self, slot: CacheSlot, points: CachePoints, transformer: nn.Module, index: int, last: int) -> None:
        super().__init__()
        self.slot, self.points, self.index, self.last = slot, points, index, last
        self.transformer_id = id(transformer)

    def new_forward(self, module: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        forward = cast("Callable[..., Any]", self.fn_ref.original_forward)  # set by register_hook (new_forward)
        session = self.slot.session
        if session is None:
            return forward(hidden_states, *args, **kwargs)
        if self.index == 0:
            return self._first(session, forward, hidden_states, args, kwargs)
        call = session.call - 1  # block 0 counted this call
        points = self.points
        if session.skip:
            if self.index == self.last:
                hidden_states = hidden_states + session.method.replay(session, call, hidden_states)
            return points.passed_on(hidden_states, args, kwargs)
        out = forward(hidden_states, *args, **kwargs)
        if self.index == self.last:
            session.method.computed(session, call, points.video(out) - session.starts.pop(call))
        return out

    def _first(
        self,
        session: CacheSession,
        forward: Callable[..., Any],
        hidden_states: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        call = session.call
        session.call += 1
        method = session.method
        if call == 0:
            session.switch(self.transformer_id)
            if not method.decides_after_first_block:
                session.decided(method.decide(session))
        if not method.decides_after_first_block:
            if session.skip:  # every block skipped: this one hands its input on, the last adds the replay
                return self.points.passed_on(hidden_states, args, kwargs)
            session.starts[call] = hidden_states
            return forward(hidden_states, *args, **kwargs)
        out = forward(hidden_states, *args, **kwargs)
        video = self.points.video(out)
        if call == 0:
            contributes = session.decision.contributes(0)
            session.decided(method.decide_from_first_block(session, video - hidden_states, contributes))
        if not session.skip:
            session.starts[call] = video
        return out


@dataclass
class StepCachePlan:
    """Hooks every block of `component` (the attribute its family's `points` name) to read `slot`; the undo
    removes the hooks."""

    component: str
    points: CachePoints
    slot: CacheSlot
    name: ClassVar[str] = HOOK_NAME

    def apply(self, module: nn.Module) -> Callable[[], None]:
        blocks = list(getattr(module, self.points.blocks, []))
        if len(blocks) < 2:
            raise TypeError(
                f"{self.component} ({type(module).__name__}) has no list of at least two blocks at "
                f"{self.points.blocks!r} (the family's cache points)"
            )
        last = len(blocks) - 1
        for index, block in enumerate(blocks):
            hook = _BlockHook(self.slot, self.points, module, index, last)
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, HOOK_NAME)

        def undo() -> None:
            for block in blocks:
                HookRegistry.check_if_exists_or_initialize(block).remove_hook(HOOK_NAME, recurse=False)
                restored = vars(block).get("forward")  # diffusers puts back the bound forward it found
                if getattr(restored, "__func__", None) is type(block).forward:
                    del block.forward  # the class's forward shows again, as loaded

        return undo
