"""A random-weight checkpoint with the exact shapes of ``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``, built on the
device it will run on (issue 56: the 14B row of the public speed table, measured without a download).

The published layout (``WanImageToVideoPipeline``): a 40-layer transformer 5120 wide (40 heads x 128, ffn 13824,
36 input channels, image cross-attention over 1280-wide CLIP tokens), CLIP ViT-H/14 (32 layers, 1280 wide, 16 heads,
224 px crops of 14 px patches: 257 tokens), the UMT5-XXL encoder (24 layers, d_model 4096, 64 heads x 64, ffn
10240, vocabulary 256384) and the Wan2.1 VAE (base_dim 96, z_dim 16). The transformer and the encoders are drawn on
`device` in `dtype` (:func:`distvideo.testing.components.on_device`): on a GPU they never exist in float32 on the
host. Parameters, counted on the meta device: 16.39 B transformer, 5.68 B text encoder, 0.63 B CLIP, 0.13 B VAE
(45.9 GB with the VAE in float32); writing them is what takes the time. The tokenizer is the tiny one (ids below 512
of the real vocabulary): text encoding runs the real encoder's compute on other token ids.

    build_wan21_i2v_14b_checkpoint("/tmp/wan14b", device="cuda")                     # 45.9 GB of weights
    build_wan21_i2v_14b_checkpoint(tmp_path / "w", **WAN21_I2V_14B_SMOKE)           # the same code, tiny, CPU
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from distvideo.testing.components import (
    SEED_OFFSETS,
    build_scheduler,
    build_text_encoder,
    build_transformer,
    build_vae,
    cast,
    fresh_checkpoint_folder,
    on_device,
    write_json,
)
from distvideo.testing.tokenizer import build_tiny_tokenizer, save_tokenizer

__all__ = ["WAN21_I2V_14B_CONFIG", "WAN21_I2V_14B_SMOKE", "build_wan21_i2v_14b_checkpoint"]

#: Wan2.1-I2V-14B-480P's shapes (the published configs) and the request defaults of its model card.
WAN21_I2V_14B_CONFIG: dict[str, Any] = {
    "num_layers": 40,
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "ffn_dim": 13824,
    "text_dim": 4096,
    "text_num_layers": 24,
    "text_num_heads": 64,
    "text_d_kv": 64,
    "text_d_ff": 10240,
    "text_vocab_size": 256384,
    "clip_hidden": 1280,
    "clip_layers": 32,
    "clip_heads": 16,
    "clip_intermediate": 5120,
    "clip_image_size": 224,
    "clip_patch": 14,
    "clip_projection": 1024,
    "vae_base_dim": 96,
    "dtype": torch.bfloat16,
    "seed": 14,
    "defaults": {"num_frames": 81, "height": 480, "width": 832, "num_inference_steps": 40, "guidance_scale": 5.0},
}
#: The same builder at a CPU smoke run's size (benchmarks/gpu_check.py --smoke).
WAN21_I2V_14B_SMOKE: dict[str, Any] = {
    "num_layers": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "ffn_dim": 64,
    "text_dim": 32,
    "text_num_layers": 2,
    "text_num_heads": 2,
    "text_d_kv": 8,
    "text_d_ff": 64,
    "text_vocab_size": 512,
    "clip_hidden": 32,
    "clip_layers": 2,
    "clip_heads": 2,
    "clip_intermediate": 64,
    "clip_image_size": 32,
    "clip_patch": 8,
    "clip_projection": 32,
    "vae_base_dim": 8,
    "dtype": torch.float32,
}
_IMAGE_ENCODER_SEED = 3_000


def build_wan21_i2v_14b_checkpoint(out_dir: str | Path, *, device: str = "cpu", **overrides: Any) -> Path:
    """Write the checkpoint (:data:`WAN21_I2V_14B_CONFIG`, keys overridden by `overrides`) to `out_dir`, drawing
    the transformer, text and image encoders on `device`; the VAE (127 M parameters) is built on the host in float32,
    as the published one is stored. Returns the folder."""
    import diffusers
    from transformers.utils import logging as hf_logging

    c = {**WAN21_I2V_14B_CONFIG, **overrides}
    unknown = set(overrides) - set(WAN21_I2V_14B_CONFIG)
    if unknown:
        raise ValueError(f"unknown overrides {sorted(unknown)}; choose from {sorted(WAN21_I2V_14B_CONFIG)}")
    out = fresh_checkpoint_folder(out_dir)
    hf_logging.disable_progress_bar()
    scheduler = build_scheduler("unipc")  # flow_shift 3.0, as the 480P checkpoint ships
    scheduler.save_pretrained(out / "scheduler")
    tokenizer = build_tiny_tokenizer(512)
    save_tokenizer(tokenizer, out / "tokenizer", 512)
    seed, dtype = c["seed"], c["dtype"]
    heads, head_dim = c["num_attention_heads"], c["attention_head_dim"]
    transformer = build_transformer(
        num_layers=c["num_layers"],
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        ffn_dim=c["ffn_dim"],
        text_dim=c["text_dim"],
        freq_dim=256,
        z_dim=16,
        seed=seed + SEED_OFFSETS["transformer"],
        in_channels=36,
        image_dim=c["clip_hidden"],
        device=device,
        dtype=dtype,
    )
    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    del transformer
    text_encoder = build_text_encoder(
        vocab_size=c["text_vocab_size"],
        d_model=c["text_dim"],
        num_layers=c["text_num_layers"],
        num_heads=c["text_num_heads"],
        d_kv=c["text_d_kv"],
        d_ff=c["text_d_ff"],
        seed=seed + SEED_OFFSETS["text_encoder"],
        device=device,
        dtype=dtype,
    )
    text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)
    del text_encoder
    _save_image_encoder(out, c, device)
    vae = build_vae(base_dim=c["vae_base_dim"], z_dim=16, seed=seed + SEED_OFFSETS["vae"])
    cast(vae, torch.float32).save_pretrained(out / "vae", safe_serialization=True)
    write_json(
        out / "model_index.json",
        {
            "_class_name": "WanImageToVideoPipeline",
            "_diffusers_version": diffusers.__version__,
            "scheduler": ["diffusers", type(scheduler).__name__],
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "WanTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"],
            "image_encoder": ["transformers", "CLIPVisionModel"],
            "image_processor": ["transformers", "CLIPImageProcessor"],
        },
    )
    write_json(out / "distvideo_defaults.json", dict(c["defaults"]))
    return out


def _save_image_encoder(out: Path, c: dict[str, Any], device: str) -> None:
    """CLIP ViT-H/14's vision tower (what Wan2.1 I2V ships as ``image_encoder``) and its 224 px processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=c["clip_hidden"],
        intermediate_size=c["clip_intermediate"],
        num_hidden_layers=c["clip_layers"],
        num_attention_heads=c["clip_heads"],
        image_size=c["clip_image_size"],
        patch_size=c["clip_patch"],
        projection_dim=c["clip_projection"],
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )
    seed = c["seed"] + _IMAGE_ENCODER_SEED
    on_device(lambda: CLIPVisionModel(config), seed=seed, device=device, dtype=c["dtype"]).save_pretrained(
        out / "image_encoder", safe_serialization=True
    )
    size = c["clip_image_size"]
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor.save_pretrained(out / "image_processor")
