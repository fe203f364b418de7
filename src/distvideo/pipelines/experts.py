"""Wan2.2 A14B's mixture of experts: which transformer denoises a step, and where the other one waits.

The two experts share one architecture and split the noise levels: the high-noise expert (`transformer`) runs while
the timestep is at least ``boundary_ratio * num_train_timesteps``, the low-noise expert (`transformer_2`) after, each
with its own guidance scale (diffusers' WanPipeline and WanImageToVideoPipeline, step for step).

Only the active expert needs to be on the device. On CUDA the other one waits in pinned host memory and the two swap
at the boundary (once per request, twice when a request starts where the previous one ended): the outgoing expert's
tensors are copied to the host on a side stream, block by block, while the incoming expert's blocks are copied in on
the compute stream as soon as the matching outgoing block is out, so the two directions overlap and the device
holds one expert plus one block at the peak. On the CPU the "device" is the host memory that holds both experts
anyway: nothing moves and nothing is saved.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

HIGH_NOISE, LOW_NOISE = "transformer", "transformer_2"


@dataclass(frozen=True)
class ExpertStep:
    """The expert that denoises one step, with its guidance scale."""

    name: str
    guidance_scale: float


def boundary_timestep(boundary_ratio: float, num_train_timesteps: int) -> float:
    """The timestep at which the low-noise expert takes over (diffusers: boundary_ratio * num_train_timesteps)."""
    return boundary_ratio * num_train_timesteps


def expert_for_step(t: torch.Tensor | float, boundary: float, guidance: float, guidance_2: float) -> ExpertStep:
    """The high-noise expert while t >= boundary, the low-noise one below it."""
    if t >= boundary:
        return ExpertStep(HIGH_NOISE, guidance)
    return ExpertStep(LOW_NOISE, guidance_2)


def _tensor_slots(module: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """(owner, name, is_parameter) of every parameter and buffer of `module`, in a fixed order."""
    slots: list[tuple[nn.Module, str, bool]] = []
    for owner in module.modules():
        slots += [(owner, name, True) for name, _ in owner.named_parameters(recurse=False)]
        slots += [(owner, name, False) for name, b in owner.named_buffers(recurse=False) if b is not None]
    return slots


def swap_chunks(module: nn.Module) -> list[list[tuple[nn.Module, str, bool]]]:
    """The tensors of a Wan transformer in swap order: one chunk per block, then one for everything else."""
    blocks = list(getattr(module, "blocks", []))
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    rest = [slot for slot in _tensor_slots(module) if id(slot[0]) not in in_blocks]
    return [_tensor_slots(block) for block in blocks] + [rest]


def _get(slot: tuple[nn.Module, str, bool]) -> torch.Tensor:
    owner, name, _ = slot
    return getattr(owner, name)


def _set_data(slot: tuple[nn.Module, str, bool], value: torch.Tensor) -> None:
    owner, name, is_parameter = slot
    if is_parameter:
        getattr(owner, name).data = value
    else:
        setattr(owner, name, value)  # nn.Module.__setattr__ replaces a registered buffer


class ExpertResidency:
    """Keeps exactly one expert's weights on `device` when `offload` is on (the default on CUDA), moving them at a
    switch; with `offload` off (the default on CPU) both stay where they were loaded and `activate` does nothing."""

    def __init__(self, experts: dict[str, nn.Module], device: torch.device, *, offload: bool | None = None):
        self.experts = experts
        self.device = device
        self.offload = device.type == "cuda" if offload is None else offload
        self.active = HIGH_NOISE
        self.counts: Counter[str] = Counter()
        self.last_swap_s = 0.0
        self._host: dict[str, list[torch.Tensor]] = {}  # an expert's host copies (pinned on CUDA), once made
        if not self.offload:
            for module in experts.values():
                module.to(device)
            if device.type == "cpu":
                logger.debug("two experts on the CPU: both stay in host memory (nothing to swap)")
            return
        experts[HIGH_NOISE].to(device)
        for name, module in experts.items():
            if name != HIGH_NOISE:
                self._host[name] = [self._pinned(_get(slot)) for chunk in swap_chunks(module) for slot in chunk]
                self._point_at_host(name)

    def _pinned(self, x: torch.Tensor) -> torch.Tensor:
        host = x.detach().to("cpu")
        return host.pin_memory() if self.device.type == "cuda" else host.clone()

    def _point_at_host(self, name: str) -> None:
        slots = [slot for chunk in swap_chunks(self.experts[name]) for slot in chunk]
        for slot, host in zip(slots, self._host[name], strict=True):
            _set_data(slot, host)

    def resident_bytes(self, name: str) -> int:
        module = self.experts[name]
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    def activate(self, name: str) -> None:
        """Make `name` the expert on the device (a no-op when it is, or without offloading)."""
        if name == self.active or not self.offload:
            self.active = name
            self.last_swap_s = 0.0
            return
        start = time.perf_counter()
        self._swap(self.active, name)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_swap_s = time.perf_counter() - start
        self.counts["swaps"] += 1
        logger.debug(
            "experts: %s on %s, %s to host memory in %.2f s (%.2f GiB each)",
            name,
            self.device,
            self.active,
            self.last_swap_s,
            self.resident_bytes(name) / 2**30,
        )
        self.active = name

    def _swap(self, outgoing: str, incoming: str) -> None:
        out_chunks = swap_chunks(self.experts[outgoing])
        in_chunks = swap_chunks(self.experts[incoming])
        if outgoing not in self._host:
            self._host[outgoing] = [self._pinned_like(_get(slot)) for chunk in out_chunks for slot in chunk]
        hosts = iter(self._host[outgoing])
        if self.device.type != "cuda":
            for chunk_out, chunk_in in zip(out_chunks, in_chunks, strict=True):
                for slot in chunk_out:
                    host = next(hosts)
                    host.copy_(_get(slot).detach())
                    _set_data(slot, host)
                for slot in chunk_in:
                    _set_data(slot, _get(slot).detach().to(self.device))
            return
        compute = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(compute)  # the last step's kernels read the outgoing weights
        done: list[Any] = []
        host_of: list[list[torch.Tensor]] = []
        with torch.cuda.stream(side):  # device -> host, all chunks queued at once
            for chunk in out_chunks:
                host_of.append([next(hosts) for _ in chunk])
                for slot, host in zip(chunk, host_of[-1], strict=True):
                    host.copy_(_get(slot).detach(), non_blocking=True)
                done.append(side.record_event())
        for k, (chunk_out, chunk_in) in enumerate(zip(out_chunks, in_chunks, strict=True)):
            done[k].synchronize()  # chunk k is on the host: its device memory may be reused right away
            for slot, host in zip(chunk_out, host_of[k], strict=True):
                _set_data(slot, host)
            for slot in chunk_in:  # host -> device on the compute stream, overlapping the next chunks' copies out
                _set_data(slot, _get(slot).detach().to(self.device, non_blocking=True))

    def _pinned_like(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=self.device.type == "cuda")
