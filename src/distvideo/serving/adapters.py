"""LoRA adapters in a service: the engine's own (`--lora`, on for every job) and the registered ones a request may
choose (`--lora-adapter NAME=PATH`, on for that job only). Every rank runs the same calls in the same order (each is a
two-phase LoRA transaction over all ranks), so the weights agree everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from distvideo.config import LoraSpec

if TYPE_CHECKING:
    from distvideo.protocols import GeneratorHandle

Active = tuple[tuple[str, float], ...]


class Adapters:
    def __init__(self, gen: GeneratorHandle, base: list[LoraSpec], registered: dict[str, str]):
        self.gen = gen
        self.base: Active = tuple((f"engine:{i}:{Path(s.path).stem}", s.strength) for i, s in enumerate(base))
        self._paths = {nick: spec.path for (nick, _), spec in zip(self.base, base, strict=True)}
        self._paths.update({f"request:{name}": path for name, path in registered.items()})
        self.active: Active = ()

    def load(self) -> None:
        """Read every file once (cached by nickname on every rank), then leave the engine's own adapters on."""
        for nick, path in self._paths.items():
            self.gen.set_lora_adapter(nick, path, strength=1.0)  # each replaces the previous: the last stays on
            self.active = ((nick, 1.0),)
        self._switch(self.base)

    def for_job(self, choice: tuple[str, float] | None) -> None:
        """Adapters on for the next job: the engine's, plus the request's choice."""
        wanted = self.base + (((f"request:{choice[0]}", float(choice[1])),) if choice else ())
        self._switch(wanted)

    def _switch(self, wanted: Active) -> None:
        if wanted == self.active:
            return
        if not wanted:
            self.gen.clear_lora_adapters()
        for i, (nick, strength) in enumerate(wanted):
            self.gen.set_lora_adapter(nick, None, strength=strength, accumulate=i > 0)
        self.active = wanted
