"""The banded decode of diffusers' AutoencoderKLWan (Wan2.1's and Wan2.2's VAE), on parallel/vae.py's machinery.

Its decoder is local in rows almost everywhere (parallel/vae.py says why): every convolution with a spatial kernel
gets the neighbours' halo rows inside a decode (the causal 3D ones with their per-frame cache, and the upsamplers'
2D ones), and the mid block's attention sees the bands gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distvideo.models import compat
from distvideo.parallel.vae import BandedVaeDecoder, conv_row_halo

# Decoder module classes (by name) known to be local in rows, or handled by this plan. Anything else in the decoder
# stops the plan from applying: a new diffusers layer might mix rows, and a wrong frame is worse than a slow one.
ROW_LOCAL_MODULES = frozenset(
    {
        "WanDecoder3d",
        "WanMidBlock",
        "WanUpBlock",
        "WanResidualUpBlock",
        "WanResidualBlock",
        "WanResample",
        "WanRMS_norm",
        "WanUpsample",
        "DupUp3D",
        "Sequential",
        "ModuleList",
        "Dropout",
        "Identity",
        "SiLU",
        "WanCausalConv3d",
        "Conv2d",
        "WanAttentionBlock",
    }
)


def apply_wan_bands(decoder: BandedVaeDecoder, vae: Any) -> None:
    """Patch `vae`'s decoder for banded decoding (its undo goes to the decoder's `remove`)."""
    WanCausalConv3d, WanAttentionBlock = compat.wan_vae_classes()
    unknown = sorted({type(m).__name__ for m in vae.decoder.modules()} - ROW_LOCAL_MODULES)
    if unknown:
        raise NotImplementedError(
            f"the banded VAE decode does not know whether {unknown} are local in rows; decode on one rank"
        )
    for module in vae.decoder.modules():
        if isinstance(module, WanCausalConv3d):
            if module.kernel_size[1] > 1:
                decoder.patch(module, _haloed_causal_conv3d(decoder, module))
        elif isinstance(module, nn.Conv2d):
            if module.kernel_size[0] > 1:
                decoder.patch(module, _haloed_conv2d(decoder, module))
        elif isinstance(module, WanAttentionBlock):
            decoder.gather_around_attention(module)


def _haloed_causal_conv3d(decoder: BandedVaeDecoder, conv: Any) -> Callable[..., torch.Tensor]:
    """WanCausalConv3d.forward with the rows' zero padding replaced by the neighbours' rows inside a decode."""
    original: Callable[..., torch.Tensor] = conv.forward  # conv: diffusers' WanCausalConv3d, not annotated
    padding = compat.causal_conv_padding(conv)
    w_pad, w_pad2, h_pad, h_pad2, t_before, t_after = padding
    if (w_pad, h_pad, t_after) != (w_pad2, h_pad2, 0):
        raise NotImplementedError(f"unexpected WanCausalConv3d padding {padding}")
    halo = conv_row_halo(conv.kernel_size[1], conv.stride[1], h_pad)

    def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if decoder.band is None:
            return original(x, cache_x)
        parts, front = [x], t_before
        if cache_x is not None and t_before > 0:  # as diffusers: the cached frames stand in for time padding
            parts, front = [cache_x.to(x.device), x], t_before - cache_x.shape[2]
            if front < 0:  # a longer cache than the padding: diffusers' F.pad crops the oldest frames
                parts, front = [cache_x.to(x.device)[:, :, -front:], x], 0
        # one buffer holding the time padding, cache, frames, halo rows and column padding: the conv's input
        return nn.Conv3d.forward(conv, decoder.haloed(parts, halo, front=front, w_pad=w_pad))

    return forward


def _haloed_conv2d(decoder: BandedVaeDecoder, conv: nn.Conv2d) -> Callable[[torch.Tensor], torch.Tensor]:
    original = conv.forward
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise NotImplementedError(f"unexpected Conv2d padding {conv.padding!r} ({conv.padding_mode})")
    h_pad, w_pad = conv.padding
    halo = conv_row_halo(conv.kernel_size[0], conv.stride[0], h_pad)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if decoder.band is None:
            return original(x)
        x = decoder.haloed([x], halo, w_pad=w_pad)
        return F.conv2d(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)

    return forward
