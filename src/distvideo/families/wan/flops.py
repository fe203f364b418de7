"""Matmul FLOPs of one ``WanTransformer3DModel`` forward (models/flops.py says what is counted), for the bench's
achieved FLOP/s and MFU; the family's `transformer_flops` declaration."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from distvideo.errors import ConfigError
from distvideo.models.flops import matmul_flops

if TYPE_CHECKING:
    from distvideo.models.registry import ModelInfo
    from distvideo.request import ResolvedRequest

__all__ = ["WAN_TRANSFORMER_DEFAULTS", "transformer_flops", "wan_transformer_flops", "wan_transformer_flops_breakdown"]

#: ``WanTransformer3DModel``'s constructor defaults (diffusers), used for keys a config.json leaves out.
WAN_TRANSFORMER_DEFAULTS: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "image_dim": None,
    "added_kv_proj_dim": None,
}


def wan_transformer_flops_breakdown(
    config: Mapping[str, Any],
    latent_shape: Sequence[int],
    text_len: int,
    *,
    image_len: int = 0,
    per_token_timesteps: bool = False,
) -> dict[str, int]:
    """Matmul FLOPs of one ``WanTransformer3DModel`` forward, by part.

    ``config`` is the transformer's config.json (a dict); ``latent_shape`` the ``(batch, channels, frames, height,
    width)`` of the latents it is given; ``text_len`` the number of text tokens in ``encoder_hidden_states``
    (the tokenizer's ``max_sequence_length``, 512 for Wan, since the pipeline pads the prompt to it).

    With B the batch, S = (F/pt)(H/ph)(W/pw) the video tokens, D = heads x head_dim, L = text_len, P = pt*ph*pw:

    - ``patch_embedding``: the Conv3d with stride = kernel is one matmul, 2*B*S*D*(C_in*P).
    - ``condition_embedder``: timestep MLP 2*B*(freq*D + D*D), its 6-way projection 2*B*D*6D, and the text
      projection MLP 2*B*L*(text_dim*D + D*D).
    - per block, ``self_attention_proj``: Q, K, V and output projections, 4 * 2*B*S*D*D.
    - per block, ``self_attention``: QK^T and AV over all heads, 2 * 2*B*S*S*D.
    - per block, ``cross_attention_proj``: Q and output projections of the video tokens, 2 * 2*B*S*D*D, plus the K
      and V projections of the text, computed once per forward in every block, 2 * 2*B*L*D*D.
    - per block, ``cross_attention``: QK^T and AV against the text, 2 * 2*B*S*L*D.
    - per block, ``ffn``: two linears D -> ffn_dim -> D, 2 * 2*B*S*D*ffn_dim.
    - ``proj_out``: 2*B*S*D*(C_out*P).

    Image conditioning (Wan2.1 I2V: ``image_dim``, ``added_kv_proj_dim``), with I = ``image_len`` CLIP tokens of width
    E = image_dim: ``image_embedder``, its MLP E -> E -> D, 2*B*I*(E*E + E*D); per block the K and V projections
    of the image tokens, 2 * 2*B*I*D*D (in ``cross_attention_proj``), and QK^T and AV against them, 2 * 2*B*S*I*D
    (in ``cross_attention``). ``latent_shape`` is the transformer's input, condition channels included.

    ``per_token_timesteps`` (Wan2.2 TI2V-5B): the timestep MLP and its 6-way projection run for every token,
    2*B*S*(freq*D + D*D) + 2*B*S*D*6D, instead of once per sample.
    """
    cfg = {**WAN_TRANSFORMER_DEFAULTS, **config}
    image = cfg.get("image_dim") is not None or cfg.get("added_kv_proj_dim") is not None
    if image and image_len < 1:
        raise ValueError("an image-conditioned transformer (image_dim is set) needs image_len, its image tokens")
    if len(latent_shape) != 5:
        raise ValueError(f"latent_shape={tuple(latent_shape)} must be (batch, channels, frames, height, width)")
    batch, channels, frames, height, width = (int(x) for x in latent_shape)
    pt, ph, pw = (int(x) for x in cfg["patch_size"])
    if frames % pt or height % ph or width % pw:
        raise ValueError(f"latent_shape={tuple(latent_shape)} is not divisible by patch_size={(pt, ph, pw)}")
    tokens = (frames // pt) * (height // ph) * (width // pw)
    dim = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    ffn, layers, freq, text_dim = (int(cfg[k]) for k in ("ffn_dim", "num_layers", "freq_dim", "text_dim"))
    out_channels = int(cfg["out_channels"] or cfg["in_channels"])
    patch = pt * ph * pw

    s, d, t = batch * tokens, dim, batch * text_len
    i = batch * image_len if image else 0
    per_block = {
        "self_attention_proj": 4 * matmul_flops(s, d, d),
        "self_attention": 2 * batch * matmul_flops(tokens, tokens, d),
        "cross_attention_proj": 2 * matmul_flops(s, d, d) + 2 * matmul_flops(t, d, d) + 2 * matmul_flops(i, d, d),
        "cross_attention": 2 * batch * (matmul_flops(tokens, text_len, d) + matmul_flops(tokens, i // batch, d)),
        "ffn": matmul_flops(s, ffn, d) + matmul_flops(s, d, ffn),
    }
    steps = s if per_token_timesteps else batch  # rows of the timestep MLP
    out = {
        "patch_embedding": matmul_flops(s, d, channels * patch),
        "condition_embedder": matmul_flops(steps, d, freq)
        + matmul_flops(steps, d, d)
        + matmul_flops(steps, 6 * d, d)
        + matmul_flops(t, d, text_dim)
        + matmul_flops(t, d, d),
        **{name: layers * value for name, value in per_block.items()},
        "proj_out": matmul_flops(s, out_channels * patch, d),
    }
    if image:
        e = int(cfg["image_dim"])
        out["image_embedder"] = matmul_flops(i, e, e) + matmul_flops(i, d, e)
    return out


def wan_transformer_flops(config: Mapping[str, Any], latent_shape: Sequence[int], text_len: int, **kwargs: Any) -> int:
    """Total matmul FLOPs of one ``WanTransformer3DModel`` forward (see :func:`wan_transformer_flops_breakdown`)."""
    return sum(wan_transformer_flops_breakdown(config, latent_shape, text_len, **kwargs).values())


def transformer_flops(info: ModelInfo, request: ResolvedRequest, input_shape: Sequence[int]) -> dict[str, int]:
    """The breakdown for a resolved request of a Wan checkpoint: its text length, its CLIP tokens (Wan2.1 I2V), its
    per-token timesteps (Wan2.2 TI2V-5B)."""
    return wan_transformer_flops_breakdown(
        info.transformer_config,
        input_shape,
        request.max_sequence_length,
        image_len=_clip_tokens(info.path) if info.family.image_encoder else 0,
        per_token_timesteps=info.family.expand_timesteps,
    )


def _clip_tokens(model: Any) -> int:
    """Image tokens of the checkpoint's CLIP vision encoder: one per patch of its input, plus the class token."""
    try:
        config = json.loads((model / "image_encoder" / "config.json").read_text())
        return (int(config["image_size"]) // int(config["patch_size"])) ** 2 + 1
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--model {model}: cannot read image_encoder/config.json ({exc})") from None
