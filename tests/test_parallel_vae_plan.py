"""The banded VAE decode plan refuses a decoder it cannot prove row-local, before changing anything; a VAE its family
declares no bands for is decoded whole on one rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distvideo.families.wan.vae import apply_wan_bands
from distvideo.parallel.vae import BandedVaeDecoder


class MysteryMix(nn.Module):
    """A layer the plan has never seen (it could mix rows, as a future diffusers layer might)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_an_unknown_decoder_module_is_refused_and_nothing_is_patched():
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False])
    vae.decoder.up_blocks[0].add_module("mystery", MysteryMix())
    plan = BandedVaeDecoder(
        group_for=lambda size: pytest.fail("no process group may be asked for"), rank=0, world_size=2
    )
    plan.apply(vae)  # no declaration (ParallelContext.plans sets the family's): nothing patched, one rank decodes
    assert plan.banded is False and not any("forward" in vars(m) for m in vae.decoder.modules())
    plan.bands, plan.banded_vae = apply_wan_bands, "AutoencoderKLWan"  # Wan's declaration (families/wan/)
    plan.banded = True
    with pytest.raises(NotImplementedError, match=r"\['MysteryMix'\] are local in rows; decode on one rank"):
        plan.apply(vae)
    assert not any({"forward", "_conv_forward"} & set(vars(m)) for m in vae.decoder.modules()), "half-applied"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in vae.decoder.modules())
    vae.decoder.up_blocks[0].mystery = nn.Identity()  # the same decoder with only known modules is accepted
    plan.apply(vae)
