"""HunyuanVideo 1.5, declared: its registry entries (model_index.json classes, components, request defaults), the
image-to-video size rule and what its checkpoint's guider may say; registered on import. The pipelines are t2v.py and
i2v.py; the shared machinery does the rest."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from distvideo.errors import ConfigError
from distvideo.families.hunyuan15.flops import HUNYUAN15_TOKENS, transformer_flops
from distvideo.models.family import IMAGE_REQUIRED, CachePoints, ModelFamily, register_family

# HunyuanVideo 1.5: diffusers' HunyuanVideo15Pipeline defaults (121 frames, 50 steps, the 16:9 bucket of the
# transformer's target size: 480 x 848 for the 480p models' 640, 720 x 1280 for 960; probe_model reads it), 24 fps as
# the model card's videos; the guidance scale is the checkpoint's guider config (6.0 where it names none).
_COMPONENTS = (
    "transformer",
    "vae",
    "text_encoder",
    "tokenizer",
    "scheduler",
    "text_encoder_2",
    "tokenizer_2",
    "guider",
)
_DEFAULTS = {
    "num_frames": 121,
    "height": 480,
    "width": 848,
    "num_inference_steps": 50,
    "guidance_scale": 6.0,
    "fps": 24,
}
#: what --quantize leaves in full precision: the image, text (with its token refiner) and time embeddings, the norms
#: with their modulation layers (diffusers' layerwise-casting declaration for the class), the output projection
_FULL_PRECISION = ("x_embedder", "image_embedder", "context_embedder", "time_embed", "norm", "^proj_out$")
#: the step cache's points: the dual-stream (MMDiT) blocks, whose text stream passes through a skipped step
_CACHE_POINTS = CachePoints("transformer_blocks", text_stream=True)


def image_size_bucket(image_height: int, image_width: int, target_size: int) -> tuple[int, int]:
    """(height, width) HunyuanVideo15ImageToVideoPipeline generates for an image of this size: the bucket (multiples of
    16 around target_size^2 pixels) closest to its aspect ratio."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=16)
    height, width = processor.calculate_default_height_width(image_height, image_width, target_size)
    return int(height), int(width)


# The guider settings whose arithmetic the pipelines reproduce: uncond + scale * (cond - uncond) on every step.
_GUIDER_EXACT = {"guidance_rescale": 0.0, "use_original_formulation": False, "start": 0.0, "stop": 1.0}


def guider_defaults(root: Path, guider: dict[str, Any]) -> dict[str, Any]:
    """The request defaults a checkpoint's ``guider/guider_config.json`` sets (its guidance scale); a guider setting
    whose arithmetic the pipeline does not reproduce is refused (ConfigError) before any weight loads."""
    for key, exact in _GUIDER_EXACT.items():
        if guider.get(key, exact) != exact:
            raise ConfigError(
                f"--model {root}: its guider has {key}={guider[key]!r}, which distvideo does not run yet (it runs "
                f"classifier-free guidance with {key}={exact!r}); set it so in guider/guider_config.json"
            )
    scale = guider.get("guidance_scale")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return {"guidance_scale": float(scale)}
    return {}


def _checkpoint_defaults(root: Path, index: dict[str, Any], transformer: dict[str, Any]) -> dict[str, Any]:
    """Its guider's scale, and the size: diffusers' 16:9 bucket of the transformer's target size (480 x 848 at 640,
    720p at 960)."""
    from distvideo.models.registry import read_checkpoint_json

    defaults = guider_defaults(root, read_checkpoint_json(root / "guider" / "guider_config.json", "guider config"))
    if "target_size" in transformer:
        defaults["height"], defaults["width"] = image_size_bucket(9, 16, int(transformer["target_size"]))
    return defaults


def _size_for_image(rows: int, cols: int, transformer: dict[str, Any]) -> tuple[int, int]:
    return image_size_bucket(rows, cols, int(transformer.get("target_size", 640)))


#: what a step attends to besides the video: the Qwen2.5-VL and ByT5 tokens and the image tokens (all computed)
_TEXT_TOKENS = sum(HUNYUAN15_TOKENS.values())
HUNYUAN15_T2V = ModelFamily(
    name="HunyuanVideo 1.5 T2V",
    example_checkpoint="hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
    class_names=("HunyuanVideo15Pipeline",),
    pipeline="distvideo.families.hunyuan15.t2v:HunyuanVideo15T2VPipeline",
    components=_COMPONENTS,
    defaults=_DEFAULTS,
    description="HunyuanVideo 1.5 text-to-video (Qwen2.5-VL and ByT5 text, dual-stream transformer, 16x VAE)",
    compact_text_off=(
        "its text joins the video tokens in one joint attention under a mask, not the text-only cross-attention the "
        "plan compacts"
    ),
    full_precision=_FULL_PRECISION,
    cache_points=_CACHE_POINTS,
    checkpoint_defaults=_checkpoint_defaults,
    text_tokens=_TEXT_TOKENS,
    transformer_flops=transformer_flops,
    libraries=(
        ("diffusers", ("HunyuanVideo15Transformer3DModel", "AutoencoderKLHunyuanVideo15", "ClassifierFreeGuidance")),
        (
            "transformers",
            ("Qwen2_5_VLTextModel", "T5EncoderModel", "Qwen2Tokenizer", "ByT5Tokenizer", "SiglipVisionModel"),
        ),
    ),
)
# Image-to-video: as diffusers' HunyuanVideo15ImageToVideoPipeline, the size is the bucket of the image's aspect ratio
# at the transformer's target size (480 x 848 stands for it until the image is read); a request may set its own.
HUNYUAN15_I2V = dataclasses.replace(
    HUNYUAN15_T2V,
    name="HunyuanVideo 1.5 I2V",
    example_checkpoint="hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v",
    class_names=("HunyuanVideo15ImageToVideoPipeline",),
    pipeline="distvideo.families.hunyuan15.i2v:HunyuanVideo15I2VPipeline",
    components=(*_COMPONENTS, "image_encoder", "feature_extractor"),
    description="HunyuanVideo 1.5 image-to-video: SigLIP image tokens, first-frame latents with a mask",
    image=IMAGE_REQUIRED,
    image_encoder=True,
    size_for_image=_size_for_image,
)

register_family(HUNYUAN15_T2V, HUNYUAN15_I2V)
