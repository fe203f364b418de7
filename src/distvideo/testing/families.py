"""Random-weight checkpoints in the shape of each Wan family beyond Wan2.1 text-to-video, for tests and benchmarks.

Each builder writes a complete diffusers-format folder laid out like the published checkpoint of its family, with
the family's structure at a tiny width (built from the same parts as the Wan2.1 checkpoints of
:mod:`distvideo.testing.checkpoints`: :mod:`distvideo.testing.components` and the tiny tokenizer):

- ``wan21_i2v``: ``WanImageToVideoPipeline`` like ``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``: a CLIP vision encoder and
  its image processor, a transformer with image cross-attention (``image_dim``, ``added_kv_proj_dim``) taking 36
  input channels (16 noise + 4 mask + 16 condition);
- ``wan22_t2v_a14b`` / ``wan22_i2v_a14b``: ``WanPipeline`` / ``WanImageToVideoPipeline`` with two experts
  (``transformer``, ``transformer_2``) and ``boundary_ratio`` like ``Wan-AI/Wan2.2-T2V-A14B-Diffusers`` and
  ``Wan-AI/Wan2.2-I2V-A14B-Diffusers`` (no CLIP);
- ``wan22_ti2v_5b``: ``WanPipeline`` with ``expand_timesteps`` and the Wan2.2 VAE (z_dim 48, patch size 2, residual
  blocks, spatial factor 16) like ``Wan-AI/Wan2.2-TI2V-5B-Diffusers``.

    build_family_checkpoint("wan22_ti2v_5b", tmp_path / "ti2v", scheduler="flow")
"""

from __future__ import annotations

from collections.abc import Mapping
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
    init_weights,
    write_json,
)
from distvideo.testing.tokenizer import build_tiny_tokenizer, save_tokenizer

__all__ = ["FAMILY_BUILDS", "build_family_checkpoint", "with_scheduler", "write_test_image"]

_SEED_OFFSETS = {**SEED_OFFSETS, "transformer_2": 500, "image_encoder": 3_000}

#: What each family's checkpoint holds: pipeline class, experts, boundary, timesteps per token, image encoder, VAE.
FAMILY_BUILDS: dict[str, dict[str, Any]] = {
    "wan21_i2v": {
        "class_name": "WanImageToVideoPipeline",
        "experts": 1,
        "image_encoder": True,
        "in_channels": 36,
        "vae": "wan21",
        "flow_shift": 3.0,
    },
    "wan22_t2v_a14b": {
        "class_name": "WanPipeline",
        "experts": 2,
        "boundary_ratio": 0.875,
        "in_channels": 16,
        "vae": "wan21",
        "flow_shift": 12.0,
    },
    "wan22_i2v_a14b": {
        "class_name": "WanImageToVideoPipeline",
        "experts": 2,
        "boundary_ratio": 0.9,
        "in_channels": 36,
        "vae": "wan21",
        "flow_shift": 5.0,
    },
    "wan22_ti2v_5b": {
        "class_name": "WanPipeline",
        "experts": 1,
        "expand_timesteps": True,
        "in_channels": 48,
        "vae": "wan22",
        "flow_shift": 5.0,
    },
}

#: The CLIP stand-in: 32 px crops of 8 px patches, so the image context has 1 + 16 = 17 tokens (Wan2.1 I2V: 257).
_CLIP_IMAGE_SIZE = 32


def _vae(kind: str, *, base_dim: int, seed: int) -> Any:
    if kind == "wan21":
        return build_vae(base_dim=base_dim, z_dim=16, seed=seed)
    # the Wan2.2 VAE: 48 latent channels, 2x2 patchified pixels, residual up/down blocks, spatial factor 16
    return build_vae(
        base_dim=base_dim,
        z_dim=48,
        seed=seed,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        decoder_base_dim=2 * base_dim,
    )


def _image_encoder(*, hidden: int, seed: int) -> tuple[Any, Any]:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=_CLIP_IMAGE_SIZE,
        patch_size=8,
        projection_dim=hidden,
    )
    model = CLIPVisionModel(config)
    init_weights(model, seed)
    processor = CLIPImageProcessor(
        size={"shortest_edge": _CLIP_IMAGE_SIZE}, crop_size={"height": _CLIP_IMAGE_SIZE, "width": _CLIP_IMAGE_SIZE}
    )
    return model.eval(), processor


def build_family_checkpoint(
    family: str,
    out_dir: str | Path,
    *,
    scheduler: str = "unipc",
    seed: int = 0,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 8,
    text_dim: int = 32,
    vae_base_dim: int = 8,
    defaults: Mapping[str, Any] | None = None,
) -> Path:
    """Write a random-weight checkpoint of `family` (a key of :data:`FAMILY_BUILDS`) to `out_dir`; returns its path.

    `out_dir` is replaced if it is empty or an earlier checkpoint. The second expert of a two-expert family has the
    same shape as the first and weights from another seed. `defaults` goes to ``distvideo_defaults.json``."""
    if family not in FAMILY_BUILDS:
        raise ValueError(f"family={family!r} is not one of {', '.join(FAMILY_BUILDS)}")
    spec = FAMILY_BUILDS[family]
    out = fresh_checkpoint_folder(out_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        index = _write_family(
            out,
            spec,
            scheduler=scheduler,
            seed=seed,
            layers=num_layers,
            width=(num_attention_heads, attention_head_dim),
            text_dim=text_dim,
            vae_base_dim=vae_base_dim,
        )
    write_json(out / "model_index.json", index)
    if defaults is not None:
        write_json(out / "distvideo_defaults.json", dict(defaults))
    return out


def _write_family(
    out: Path,
    spec: dict[str, Any],
    *,
    scheduler: str,
    seed: int,
    layers: int,
    width: tuple[int, int],
    text_dim: int,
    vae_base_dim: int,
) -> dict[str, Any]:
    import diffusers
    from transformers.utils import logging as hf_logging

    sched = build_scheduler(scheduler)
    sched.register_to_config(
        **({"flow_shift": spec["flow_shift"]} if scheduler == "unipc" else {"shift": spec["flow_shift"]})
    )
    sched.save_pretrained(out / "scheduler")
    tokenizer = build_tiny_tokenizer(512)
    save_tokenizer(tokenizer, out / "tokenizer", 512)

    z_dim = 48 if spec["vae"] == "wan22" else 16
    clip_hidden = 32 if spec.get("image_encoder") else None
    experts = ["transformer", "transformer_2"][: spec["experts"]]
    for name in experts:
        heads, head_dim = width
        model = build_transformer(
            num_layers=layers,
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            ffn_dim=2 * heads * head_dim,
            text_dim=text_dim,
            freq_dim=256,
            z_dim=z_dim,
            seed=seed + _SEED_OFFSETS[name],
            in_channels=spec["in_channels"],
            image_dim=clip_hidden,
        )
        model.save_pretrained(out / name, safe_serialization=True)
    _vae(spec["vae"], base_dim=vae_base_dim, seed=seed + _SEED_OFFSETS["vae"]).save_pretrained(
        out / "vae", safe_serialization=True
    )
    text_encoder = build_text_encoder(
        vocab_size=tokenizer.get_vocab_size(),
        d_model=text_dim,
        num_layers=2,
        num_heads=2,
        d_kv=8,
        d_ff=64,
        seed=seed + _SEED_OFFSETS["text_encoder"],
    )
    hf_logging.disable_progress_bar()
    cast(text_encoder, torch.float32).save_pretrained(out / "text_encoder", safe_serialization=True)
    index: dict[str, Any] = {
        "_class_name": spec["class_name"],
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", type(sched).__name__],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if clip_hidden is not None:
        encoder, processor = _image_encoder(hidden=clip_hidden, seed=seed + _SEED_OFFSETS["image_encoder"])
        encoder.save_pretrained(out / "image_encoder", safe_serialization=True)
        processor.save_pretrained(out / "image_processor")
        index["image_encoder"] = ["transformers", "CLIPVisionModel"]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    if spec["experts"] == 2:
        index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
        index["boundary_ratio"] = spec["boundary_ratio"]
    if spec.get("expand_timesteps"):
        index["expand_timesteps"] = True
    return index


def write_test_image(path: str | Path, width: int = 40, height: int = 28, seed: int = 0) -> Path:
    """A smooth random RGB image (PNG) of the given size, for image-to-video requests."""
    import numpy as np
    from PIL import Image

    gen = torch.Generator("cpu").manual_seed(seed)
    coarse = torch.rand(3, 4, 5, generator=gen)[None]
    smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)[0]
    pixels = (smooth.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return Path(path)


def with_scheduler(checkpoint: str | Path, out_dir: str | Path, scheduler: str) -> Path:
    """A view of `checkpoint` with another scheduler ("flow" or "unipc", with the checkpoint's shift): its component
    folders linked, `scheduler/` and `model_index.json` written anew. Cheaper than building a second checkpoint."""
    import json

    src, out = Path(checkpoint), Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    index = json.loads((src / "model_index.json").read_text())
    old = json.loads((src / "scheduler" / "scheduler_config.json").read_text())
    shift = old.get("flow_shift", old.get("shift", 3.0))
    sched = build_scheduler(scheduler)
    sched.register_to_config(**({"flow_shift": shift} if scheduler == "unipc" else {"shift": shift}))
    sched.save_pretrained(out / "scheduler")
    for entry in sorted(src.iterdir()):
        if entry.name not in ("scheduler", "model_index.json"):
            (out / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    index["scheduler"] = ["diffusers", type(sched).__name__]
    write_json(out / "model_index.json", index)
    return out
