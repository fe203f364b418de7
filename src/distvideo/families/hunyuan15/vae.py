"""The banded decode of diffusers' AutoencoderKLHunyuanVideo15, on parallel/vae.py's machinery.

Its decoder is local in rows except where the Wan one is: causal 3x3x3 convolutions (the whole video at once, no
frame cache), RMS norms over channels, SiLU, DC-AE upsampling (channels to 2x2 pixels: output row i from input row
i // 2) and the mid block's attention over the frame. Two differences: the convolutions pad by *replicating* the
edge (rows, columns and the causal frames), and 1x1x1 convolutions (the attention's projections) are plain Conv3d.
So a band's convolution input is its rows with the neighbours' halo rows, the edge row replicated only at the true
top and bottom, then columns and frames replicated as on one rank: the same values, so the same frames.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distvideo.parallel.vae import BandedVaeDecoder

#: Decoder module classes (by name) local in rows or handled here; anything else refuses the plan.
ROW_LOCAL_MODULES = frozenset(
    {
        "HunyuanVideo15Decoder3D",
        "HunyuanVideo15MidBlock",
        "HunyuanVideo15UpBlock3D",
        "HunyuanVideo15ResnetBlock",
        "HunyuanVideo15Upsample",
        "HunyuanVideo15RMS_norm",
        "HunyuanVideo15CausalConv3d",
        "HunyuanVideo15AttnBlock",
        "Conv3d",
        "ModuleList",
        "SiLU",
    }
)


def apply_hunyuan15_bands(decoder: BandedVaeDecoder, vae: Any) -> None:
    """Patch `vae`'s decoder for banded decoding: every causal convolution with a spatial kernel gets halo rows, every
    attention block gathers the bands before it and splits them after (its undo goes to `decoder.remove`)."""
    modules = list(vae.decoder.modules())
    unknown = sorted({type(m).__name__ for m in modules} - ROW_LOCAL_MODULES)
    if unknown:
        raise NotImplementedError(
            f"the banded VAE decode does not know whether {unknown} are local in rows; decode on one rank"
        )
    wrapped = {id(m.conv) for m in modules if type(m).__name__ == "HunyuanVideo15CausalConv3d"}
    for module in modules:
        name = type(module).__name__
        if name == "HunyuanVideo15CausalConv3d" and module.conv.kernel_size[1] > 1:
            decoder.patch(module, _haloed_causal_conv3d(decoder, module))
        elif name == "HunyuanVideo15AttnBlock":
            decoder.gather_around_attention(module)
        elif isinstance(module, nn.Conv3d) and id(module) not in wrapped and module.kernel_size[1] > 1:
            raise NotImplementedError(f"a bare {module} in the decoder: not known to be local in rows")


def _haloed_causal_conv3d(decoder: BandedVaeDecoder, conv: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """HunyuanVideo15CausalConv3d.forward with the rows' replicate padding replaced by the neighbours' rows inside a
    decode (replicated at the true edges, as on one rank)."""
    original: Callable[[torch.Tensor], torch.Tensor] = conv.forward
    w_pad, w_pad2, h_pad, h_pad2, t_before, t_after = conv.time_causal_padding
    if (w_pad, h_pad, t_after, conv.pad_mode) != (w_pad2, h_pad2, 0, "replicate"):
        raise NotImplementedError(f"unexpected HunyuanVideo15CausalConv3d padding {conv.time_causal_padding}")
    halo = decoder.row_halo(conv.conv.kernel_size[1], conv.conv.stride[1], h_pad)

    def forward(x: torch.Tensor) -> torch.Tensor:
        band = decoder.band
        if band is None:
            return original(x)
        rows = decoder.haloed([x], halo)  # zeros at the true edges: replicate the edge row there instead
        if band.prev_rank is None:
            rows[..., :halo, :] = rows[..., halo : halo + 1, :]
        if band.next_rank is None:
            rows[..., -halo:, :] = rows[..., -halo - 1 : -halo, :]
        padded = F.pad(rows, (w_pad, w_pad, 0, 0, t_before, 0), mode="replicate")
        out: torch.Tensor = conv.conv(padded)
        return out

    return forward
