"""Faster CPU kernels for the loaded modules, chosen per call (GPU calls are untouched).

**3D convolutions through oneDNN.** PyTorch picks oneDNN (mkldnn) for a CPU convolution only past a size heuristic
that, for 5-D inputs, multiplies batch x channels x frames x rows. The Wan VAE decodes one latent frame at a time
(plus a two-frame causal cache), so its 3x3x3 convolutions stay under the threshold and fall back to the generic
im2col kernel (``slow_conv3d_forward``). Calling oneDNN directly for those convolutions gives the same result up to
float summation order. Applied as a patch of each ``nn.Conv3d``'s ``_conv_forward`` (which ``nn.Conv3d.forward``
calls, and so does every wrapper that pads first, such as diffusers' ``WanCausalConv3d`` or our banded decode); the
returned undo removes it.

**Channel RMS norms without ``F.normalize``.** The VAE's ``WanRMS_norm`` normalises every pixel over its channels
with ``F.normalize(x, dim=1)``, a strided vector-norm reduction; ``x * rsqrt(max(sum(x * x, dim=1), eps^2))`` is the
same value, computed faster on CPU.

:func:`use_cpu_kernels` applies both; docs/performance.md has the measured effect (``benchmarks/speed_plans.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distvideo.models import compat


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def _fast_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # not while torch.compile traces (a compiled region holding a convolution, such as HunyuanVideo 1.5's patch
    # embedding among its repeated blocks): dynamo runs the op on fake tensors, which oneDNN's op refuses, and
    # inductor chooses its own convolution kernel anyway
    return (
        not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and onednn_available()
    )


def use_onednn_conv3d(module: nn.Module) -> Callable[[], None]:
    """Route every zero-padded ``nn.Conv3d`` under `module` to oneDNN on CPU float32; returns the undo."""
    undo: list[Callable[[], None]] = []
    for conv in module.modules():
        if not isinstance(conv, nn.Conv3d) or conv.padding_mode != "zeros" or compat.conv_forward_is_patched(conv):
            continue
        original = compat.conv_forward(conv)

        def conv_forward(
            x: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None,
            conv: nn.Conv3d = conv,
            original: Callable[..., torch.Tensor] = original,
        ) -> torch.Tensor:
            if not _fast_path(x, weight) or isinstance(conv.padding, str):
                return original(x, weight, bias)
            return torch.ops.aten.mkldnn_convolution(
                x.contiguous(), weight, bias, conv.padding, conv.stride, conv.dilation, conv.groups
            )

        undo.append(compat.patch_conv_forward(conv, conv_forward))

    def restore() -> None:
        for step in undo:
            step()
        undo.clear()

    return restore


def _fast_rms_norm(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """WanRMS_norm.forward: ``F.normalize`` (x / max(||x||, 1e-12)) as a sum of squares and an rsqrt on CPU."""
    original = norm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return original(x)
        dim, scale, gamma, bias = compat.rms_norm_parts(norm)
        xf = x if x.dtype == torch.float32 else x.float()  # diffusers normalises half precision in float32 too
        inverse = (xf * xf).sum(dim, keepdim=True).clamp_min_(1e-24).rsqrt_()
        if x.dtype != torch.float32:
            return (xf * inverse).to(x.dtype) * scale * gamma + bias
        out = (xf * inverse).mul_(gamma * scale)  # one full-size product fewer than diffusers' order
        return out.add_(bias) if isinstance(bias, torch.Tensor) else out

    return forward


def use_fast_rms_norms(module: nn.Module) -> Callable[[], None]:
    """Patch every diffusers ``WanRMS_norm`` under `module` (see the module docstring); returns the undo."""
    patched = [m for m in module.modules() if compat.is_channel_rms_norm(m) and "forward" not in vars(m)]
    for norm in patched:
        norm.forward = _fast_rms_norm(norm)  # type: ignore[method-assign]

    def restore() -> None:
        for norm in patched:
            del norm.forward

    return restore


def use_cpu_kernels(module: nn.Module) -> Callable[[], None]:
    """oneDNN 3D convolutions and fast channel RMS norms under `module`; returns the undo of both."""
    undo_norms, undo_convs = use_fast_rms_norms(module), use_onednn_conv3d(module)

    def restore() -> None:
        undo_norms()
        undo_convs()

    return restore
