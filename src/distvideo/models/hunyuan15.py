"""HunyuanVideo 1.5, declared: its registry entry (model_index.json class, components, request defaults) and what its
checkpoint's guider may say. The pipeline is pipelines/hunyuan15.py; the shared machinery does the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distvideo.errors import ConfigError
from distvideo.models.family import ModelFamily

# HunyuanVideo 1.5: diffusers' HunyuanVideo15Pipeline defaults (121 frames, 50 steps, the 16:9 bucket of the 480p
# models' target size 640: 480 x 848), 24 fps as the model card's videos; the guidance scale is the checkpoint's guider
# config (6.0 where it names none), read by probe_model.
HUNYUAN15_T2V = ModelFamily(
    name="HunyuanVideo 1.5 T2V",
    class_names=("HunyuanVideo15Pipeline",),
    pipeline="hunyuan15_t2v",
    components=(
        "transformer",
        "vae",
        "text_encoder",
        "tokenizer",
        "scheduler",
        "text_encoder_2",
        "tokenizer_2",
        "guider",
    ),
    defaults={
        "num_frames": 121,
        "height": 480,
        "width": 848,
        "num_inference_steps": 50,
        "guidance_scale": 6.0,
        "fps": 24,
    },
    description="HunyuanVideo 1.5 text-to-video (Qwen2.5-VL and ByT5 text, dual-stream transformer, 16x VAE)",
    compact_text=False,
)

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
