"""The model registry: model_index.json's `_class_name` -> model family and pipeline name.

`probe_model` reads only JSON files (no weights), so a request can be validated against the model
(spatial stride, heads, defaults) before any expensive work.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distvideo.config import ConfigError, GenerationRequest


@dataclass(frozen=True)
class ModelFamily:
    class_names: tuple[str, ...]
    pipeline: str  # key into distvideo.pipelines.PIPELINES
    components: tuple[str, ...]
    defaults: dict[str, Any]
    description: str


WAN_T2V = ModelFamily(
    class_names=("WanPipeline",),
    pipeline="wan_t2v",
    components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
    # diffusers' WanPipeline defaults
    defaults={"num_frames": 81, "height": 480, "width": 832, "num_inference_steps": 50, "guidance_scale": 5.0},
    description="Wan2.1 text-to-video (WanTransformer3DModel, AutoencoderKLWan, UMT5)",
)

FAMILIES: tuple[ModelFamily, ...] = (WAN_T2V,)
SUPPORTED_CLASSES: tuple[str, ...] = tuple(name for fam in FAMILIES for name in fam.class_names)
DEFAULTS_FILE = "distvideo_defaults.json"


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    class_name: str
    family: ModelFamily
    index: dict[str, Any]
    vae_scale_spatial: int
    vae_scale_temporal: int
    patch_size: tuple[int, int, int]
    num_attention_heads: int
    latent_channels: int = 16  # the transformer's in_channels (the VAE's z_dim for text-to-video)
    defaults: dict[str, Any] = field(default_factory=dict)
    transformer_config: dict[str, Any] = field(default_factory=dict)  # the JSON files, as read
    vae_config: dict[str, Any] = field(default_factory=dict)

    @property
    def spatial_stride(self) -> int:
        return self.vae_scale_spatial * max(self.patch_size[1], self.patch_size[2])

    def latent_shape(self, request: GenerationRequest) -> tuple[int, int, int, int, int]:
        """(batch, channels, latent frames, latent rows, latent columns) of a resolved request."""
        assert request.num_frames is not None and request.height is not None and request.width is not None
        return (
            1,
            self.latent_channels,
            (request.num_frames - 1) // self.vae_scale_temporal + 1,
            request.height // self.vae_scale_spatial,
            request.width // self.vae_scale_spatial,
        )

    def resolve_request(self, request: GenerationRequest) -> GenerationRequest:
        """Fill unset fields with the model's defaults and check what depends on the model."""
        filled = dataclasses.replace(
            request, **{k: v for k, v in self.defaults.items() if getattr(request, k, 0) is None}
        )
        filled.validate()
        for name in ("height", "width"):
            value = getattr(filled, name)
            if value % self.spatial_stride:
                lower = max(self.spatial_stride, value // self.spatial_stride * self.spatial_stride)
                raise ConfigError(
                    f"{name}={value} must be a multiple of {self.spatial_stride} for this model (VAE factor "
                    f"{self.vae_scale_spatial} x patch size {self.patch_size[1]}); try {lower} or "
                    f"{lower + self.spatial_stride}"
                )
        k = self.vae_scale_temporal
        assert filled.num_frames is not None  # the family's defaults fill every field
        if (filled.num_frames - 1) % k:
            lower = (filled.num_frames - 1) // k * k + 1
            raise ConfigError(
                f"num_frames={filled.num_frames} must be of the form {k}k+1 for this model (its VAE packs {k} frames "
                f"into one latent frame after the first); try {lower} or {lower + k}"
            )
        return filled


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--model: {path.parent} is not a diffusers checkpoint: {what} {path.name} is missing"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--model: {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--model: {path} must hold a JSON object")
    return data


def family_for(class_name: str) -> ModelFamily:
    for fam in FAMILIES:
        if class_name in fam.class_names:
            return fam
    raise ConfigError(
        f"--model: model_index.json has _class_name={class_name!r}, which distvideo does not run yet; "
        f"supported: {', '.join(SUPPORTED_CLASSES)}"
    )


def probe_model(path: str | Path) -> ModelInfo:
    """Read a checkpoint folder's JSON files and return what is needed before loading weights."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(f"--model {path}: no such folder; pass a diffusers-format checkpoint folder")
    if not root.is_dir():
        raise ConfigError(f"--model {path}: not a folder; pass a diffusers-format checkpoint folder")
    if not (root / "model_index.json").is_file():
        raise ConfigError(
            f"--model {path}: not a diffusers checkpoint (no model_index.json); download one with e.g. "
            "`huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir <folder>`"
        )
    index = _read_json(root / "model_index.json", "file")
    class_name = index.get("_class_name")
    if not isinstance(class_name, str):
        raise ConfigError(f"--model {path}: model_index.json has no _class_name")
    family = family_for(class_name)
    for comp in family.components:
        entry = index.get(comp)
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
            raise ConfigError(f"--model {path}: model_index.json lacks the component '{comp}' ([library, class])")
        if not (root / comp).is_dir():
            raise ConfigError(f"--model {path}: component folder '{comp}/' is missing")
    vae_cfg = _read_json(root / "vae" / "config.json", "VAE config")
    tr_cfg = _read_json(root / "transformer" / "config.json", "transformer config")
    temporal = vae_cfg.get("temperal_downsample", [False, True, True])
    scale_temporal = int(vae_cfg.get("scale_factor_temporal", 2 ** sum(bool(x) for x in temporal)))
    scale_spatial = int(vae_cfg.get("scale_factor_spatial", 2 ** len(temporal)))
    patch = tuple(int(x) for x in tr_cfg.get("patch_size", (1, 2, 2)))
    defaults = dict(family.defaults)
    if (root / DEFAULTS_FILE).is_file():
        extra = _read_json(root / DEFAULTS_FILE, "defaults")
        unknown = set(extra) - set(defaults)
        if unknown:
            raise ConfigError(f"--model {path}: {DEFAULTS_FILE} has unknown keys {sorted(unknown)}")
        defaults.update(extra)
    return ModelInfo(
        path=root.resolve(),
        class_name=class_name,
        family=family,
        index=index,
        vae_scale_spatial=scale_spatial,
        vae_scale_temporal=scale_temporal,
        patch_size=(patch[0], patch[1], patch[2]),
        num_attention_heads=int(tr_cfg.get("num_attention_heads", 1)),
        latent_channels=int(tr_cfg.get("in_channels", vae_cfg.get("z_dim", 16))),
        defaults=defaults,
        transformer_config=tr_cfg,
        vae_config=vae_cfg,
    )
