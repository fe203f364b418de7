"""Matmul FLOPs of one ``HunyuanVideo15Transformer3DModel`` forward (models/flops.py says what is counted), for the
bench's achieved FLOP/s and MFU and the layout planner's text tokens; the family's `transformer_flops` declaration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from distvideo.models.flops import matmul_flops

if TYPE_CHECKING:
    from distvideo.models.registry import ModelInfo
    from distvideo.request import ResolvedRequest

__all__ = ["HUNYUAN15_TOKENS", "hunyuan15_transformer_flops_breakdown", "transformer_flops"]

#: HunyuanVideo15Pipeline's text and image token counts (all computed, padding included) and its transformer's
#: ``HunyuanVideo15ByT5TextProjection`` width.
HUNYUAN15_TOKENS = {"mllm": 1000, "byt5": 256, "image": 729}
_BYT5_PROJECTION = 2048


def hunyuan15_transformer_flops_breakdown(config: Mapping[str, Any], latent_shape: Sequence[int]) -> dict[str, int]:
    """Matmul FLOPs of one ``HunyuanVideo15Transformer3DModel`` forward, by part (per-sample terms such as the
    timestep MLP and the adaLN projections left out with the elementwise work). ``latent_shape`` is the transformer's
    input (noise, condition latents and mask). With S video tokens, D = heads x head_dim, and the L = 1000 + 256 + 729
    text and image tokens the pipeline always passes:

    - ``patch_embedding``: 2*B*S*D*(C_in*P); ``proj_out``: 2*B*S*D*(C_out*P);
    - ``token_refiner`` over the 1000 Qwen tokens: its input projection and, per refiner layer, q/k/v/out
      projections 4 * 2*B*L1*D*D, attention 2 * 2*B*L1*L1*D and its feed-forward (4x) 2 * 2*B*L1*D*4D;
    - ``byt5_projection`` (in -> 2048 -> 2048 -> D) and ``image_projection`` (E -> E -> D);
    - per dual-stream block: ``attention_proj`` (q/k/v/out of both streams, 4 * 2*B*(S+L)*D*D), ``attention`` (the
      joint sequence, 2 * 2*B*(S+L)^2*D) and ``ffn`` (both streams, mlp_ratio, 2 * 2*B*(S+L)*D*(ratio*D))."""
    batch, channels, frames, height, width = (int(x) for x in latent_shape)
    patch, patch_t = int(config.get("patch_size", 1)), int(config.get("patch_size_t", 1))
    tokens = (frames // patch_t) * (height // patch) * (width // patch)
    dim = int(config.get("num_attention_heads", 16)) * int(config.get("attention_head_dim", 128))
    layers, refiners = int(config.get("num_layers", 54)), int(config.get("num_refiner_layers", 2))
    ratio = float(config.get("mlp_ratio", 4.0))
    l1, l2, l3 = (HUNYUAN15_TOKENS[k] for k in ("mllm", "byt5", "image"))
    joint = tokens + l1 + l2 + l3
    s, d, b = batch * tokens, dim, batch
    hidden = int(ratio * d)
    per_refiner = 4 * matmul_flops(b * l1, d, d) + 2 * b * matmul_flops(l1, l1, d) + 2 * matmul_flops(b * l1, 4 * d, d)
    text_2, image = int(config.get("text_embed_2_dim", 1472)), int(config.get("image_embed_dim", 1152))
    return {
        "patch_embedding": matmul_flops(s, d, channels * patch_t * patch * patch),
        "token_refiner": matmul_flops(b * l1, d, int(config.get("text_embed_dim", 3584))) + refiners * per_refiner,
        "byt5_projection": matmul_flops(b * l2, _BYT5_PROJECTION, text_2)
        + matmul_flops(b * l2, _BYT5_PROJECTION, _BYT5_PROJECTION)
        + matmul_flops(b * l2, d, _BYT5_PROJECTION),
        "image_projection": matmul_flops(b * l3, image, image) + matmul_flops(b * l3, d, image),
        "attention_proj": layers * 4 * matmul_flops(b * joint, d, d),
        "attention": layers * 2 * b * matmul_flops(joint, joint, d),
        "ffn": layers * 2 * matmul_flops(b * joint, hidden, d),
        "proj_out": matmul_flops(s, int(config.get("out_channels", 32)) * patch_t * patch * patch, d),
    }


def transformer_flops(info: ModelInfo, request: ResolvedRequest, input_shape: Sequence[int]) -> dict[str, int]:
    return hunyuan15_transformer_flops_breakdown(info.transformer_config, input_shape)
