"""Where the components outside the denoising loop wait between their stages (the `offload` engine option).

The text encoders run once per request (text encoding: Wan's UMT5; HunyuanVideo 1.5's Qwen2.5-VL and ByT5), the image
encoder once (Wan2.1 I2V's CLIP tokens, HunyuanVideo 1.5 I2V's SigLIP), the VAE once or twice (the first frame's
latents, the decode); the transformer runs every step. With ``offload="none"`` every component lives on the device.
With ``"text"`` the text encoders live in host memory and visit the device for the text-encoding stage only; with
``"model"`` the image encoder and the VAE do too, each for its own stage (diffusers'
``enable_model_cpu_offload``, component by component, except that the transformers never leave the device). The
inactive Wan2.2 A14B expert is another switch (``offload_experts``, pipelines/experts.py).

A visit is ``module.to(device)`` before the stage and ``module.to("cpu")`` after it, the same tensors copied both
ways, so the frames do not change. On the CPU the device is the host memory: both moves are no-ops (the bookkeeping
still runs) and nothing is saved.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")

#: the components each offload mode keeps in host memory between their stages (config.OFFLOAD_MODES)
OFFLOADED: dict[str, tuple[str, ...]] = {
    "none": (),
    "text": ("text_encoder", "text_encoder_2"),
    "model": ("text_encoder", "text_encoder_2", "image_encoder", "vae"),
}


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


class ComponentOffload:
    """The pipeline's encoders and VAE, each either resident on `device` or, when its mode offloads it, in host memory
    except inside :meth:`on_device`. `placement` says where each one is now ("device" or "host"), `moves` lists every
    move made, in order."""

    def __init__(self, modules: Mapping[str, nn.Module | None], device: torch.device, mode: str = "none"):
        if mode not in OFFLOADED:
            raise ValueError(f"offload={mode!r}: choose one of {', '.join(OFFLOADED)}")
        self.device = device
        self.mode = mode
        self.modules = {name: module for name, module in modules.items() if module is not None}
        self.offloaded = tuple(name for name in OFFLOADED[mode] if name in self.modules)
        self.placement: dict[str, str] = {}
        self.moves: list[tuple[str, str]] = []
        for name in self.modules:
            self._place(name, "host" if name in self.offloaded else "device")

    def _place(self, name: str, where: str) -> None:
        self.modules[name].to(self.device if where == "device" else HOST)
        self.placement[name] = where
        self.moves.append((name, where))

    @contextmanager
    def on_device(self, *names: str) -> Iterator[None]:
        """The named components on the device inside the block; those that live in host memory go back there after it
        (also when it raises). A resident component, or one already visiting, is left as it is."""
        visiting = [name for name in names if name in self.offloaded and self.placement[name] == "host"]
        for name in visiting:
            self._place(name, "device")
        try:
            yield
        finally:
            for name in visiting:
                self._place(name, "host")

    def device_bytes_per_visit(self) -> dict[str, int]:
        """The weight bytes each offloaded component brings onto the device for its stage: memory a request needs on
        top of what is allocated between requests. Empty on the CPU, where the device is the host memory."""
        if self.device.type == "cpu":
            return {}
        return {name: weight_bytes(self.modules[name]) for name in self.offloaded}

    def describe(self) -> str:
        if not self.offloaded:
            return "every component on the device"
        sizes = ", ".join(f"{name} {weight_bytes(self.modules[name]) / 2**20:.0f} MiB" for name in self.offloaded)
        return f"offload={self.mode}: in host memory until their stage: {sizes}"
