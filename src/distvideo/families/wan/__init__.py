"""The Wan families (Wan2.1 T2V and I2V, Wan2.2 T2V-A14B, I2V-A14B and TI2V-5B), declared: which checkpoints each
is (model_index.json's class and traits), its pipeline, its components and documented request defaults; registered
on import. The pipelines (t2v.py, i2v.py, a14b.py, ti2v.py) are imported by the worker when it loads one."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from distvideo.errors import ConfigError
from distvideo.families.wan.flops import transformer_flops
from distvideo.models.family import IMAGE_OPTIONAL, IMAGE_REQUIRED, ModelFamily, register_family

_T5 = ("vae", "text_encoder", "tokenizer", "scheduler")
_LIBRARIES = (
    ("diffusers", ("WanTransformer3DModel", "AutoencoderKLWan", "UniPCMultistepScheduler")),
    ("diffusers", ("FlowMatchEulerDiscreteScheduler", "WanPipeline")),
    ("transformers", ("UMT5EncoderModel", "T5TokenizerFast", "CLIPVisionModel")),
)


# Request defaults: diffusers' pipeline defaults and, where Wan documents its own, Wan's (sample_steps,
# sample_guide_scale, frame_num and size of wan/configs in the Wan2.1 / Wan2.2 repositories). `fps` is the rate of
# the saved video; a checkpoint's distvideo_defaults.json overrides any of them.
WAN_T2V = ModelFamily(
    name="Wan2.1 T2V",
    class_names=("WanPipeline",),
    pipeline="distvideo.families.wan.t2v:WanT2VPipeline",
    components=("transformer", *_T5),
    defaults={
        "num_frames": 81,
        "height": 480,
        "width": 832,
        "num_inference_steps": 50,
        "guidance_scale": 5.0,
        "fps": 16,
    },
    description="Wan2.1 text-to-video (WanTransformer3DModel, AutoencoderKLWan, UMT5)",
    example_checkpoint="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    compact_text="distvideo.families.wan.text_padding:TextPaddingPlan",
    transformer_flops=transformer_flops,
    libraries=_LIBRARIES,
)


def _one_image(root: Path, index: dict[str, Any], transformer: dict[str, Any]) -> dict[str, Any]:
    """Wan2.1 I2V's checkpoint sets no defaults of its own; a first-and-last-frame one (FLF2V) is refused."""
    if transformer.get("pos_embed_seq_len"):
        raise ConfigError(
            f"--model {root}: a Wan2.1 FLF2V checkpoint (first and last frame: the transformer's pos_embed_seq_len is "
            "set), which distvideo does not run yet; it runs Wan2.1 I2V (one image)"
        )
    return {}


WAN_I2V = dataclasses.replace(
    WAN_T2V,
    name="Wan2.1 I2V",
    example_checkpoint="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
    class_names=("WanImageToVideoPipeline",),
    pipeline="distvideo.families.wan.i2v:WanI2VPipeline",
    components=("transformer", *_T5, "image_encoder", "image_processor"),
    description="Wan2.1 image-to-video: CLIP image tokens in cross-attention, first-frame latents with a mask",
    image=IMAGE_REQUIRED,
    image_encoder=True,
    compact_text=None,
    compact_text_off=(
        "its cross-attention attends to CLIP image tokens in front of the text, which the plan's processor does not "
        "handle (it compacts text-only cross-attention)"
    ),
    checkpoint_defaults=_one_image,
)
WAN22_T2V_A14B = dataclasses.replace(
    WAN_T2V,
    name="Wan2.2 T2V-A14B",
    example_checkpoint="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    pipeline="distvideo.families.wan.a14b:Wan22T2VA14BPipeline",
    components=("transformer", "transformer_2", *_T5),
    defaults={
        "num_frames": 81,
        "height": 720,
        "width": 1280,
        "num_inference_steps": 40,
        "guidance_scale": 4.0,
        "guidance_scale_2": 3.0,
        "boundary_ratio": 0.875,
        "fps": 16,
    },
    description="Wan2.2 text-to-video, two experts: high-noise (transformer) then low-noise (transformer_2)",
    experts=2,
)
WAN22_I2V_A14B = dataclasses.replace(
    WAN22_T2V_A14B,
    name="Wan2.2 I2V-A14B",
    example_checkpoint="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    class_names=("WanImageToVideoPipeline",),
    pipeline="distvideo.families.wan.a14b:Wan22I2VA14BPipeline",
    defaults={**WAN22_T2V_A14B.defaults, "guidance_scale": 3.5, "guidance_scale_2": 3.5, "boundary_ratio": 0.9},
    description="Wan2.2 image-to-video, two experts, first-frame latents with a mask (no CLIP)",
    image=IMAGE_REQUIRED,
)
WAN22_TI2V_5B = dataclasses.replace(
    WAN_T2V,
    name="Wan2.2 TI2V-5B",
    example_checkpoint="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    class_names=("WanPipeline", "WanImageToVideoPipeline"),
    pipeline="distvideo.families.wan.ti2v:Wan22TI2VPipeline",
    defaults={
        "num_frames": 121,
        "height": 704,
        "width": 1280,
        "num_inference_steps": 50,
        "guidance_scale": 5.0,
        "fps": 24,
    },
    description="Wan2.2 text- and image-to-video in one model: per-token timesteps, the Wan2.2 VAE (z_dim 48)",
    image=IMAGE_OPTIONAL,
    expand_timesteps=True,
)

register_family(WAN_T2V, WAN_I2V, WAN22_T2V_A14B, WAN22_I2V_A14B, WAN22_TI2V_5B)
