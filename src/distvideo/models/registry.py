"""The model registry: model_index.json's `_class_name` -> model family and pipeline name.

`probe_model` reads only JSON files (no weights), so a request can be validated against the model
(spatial stride, heads, defaults) before any expensive work.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distvideo.config import Naming
from distvideo.errors import ConfigError
from distvideo.models.cache_ratios import CACHE_DEFAULT_KEYS, read_ratios, resolve_cache
from distvideo.models.family import IMAGE_NONE, IMAGE_REQUIRED, ModelFamily, registered_families
from distvideo.models.schedules import SCHEDULE_KEYS, Schedule, fill_schedule, schedule_for
from distvideo.request import GenerationRequest, ResolvedRequest, check_schedule_fields

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
    num_attention_heads: int  # of every expert (their greatest common divisor if they differ)
    latent_channels: int = 16  # channels of the noise latents: the VAE's z_dim (the transformer's in_channels in T2V)
    defaults: dict[str, Any] = field(default_factory=dict)
    transformer_config: dict[str, Any] = field(default_factory=dict)  # the JSON files, as read
    vae_config: dict[str, Any] = field(default_factory=dict)
    cache_ratios: dict[str, list[float]] = field(default_factory=dict)  # MagCache's, from models/cache_ratios.py
    scheduler_config: dict[str, Any] = field(default_factory=dict)  # scheduler/scheduler_config.json, as read

    def schedule(self, request: ResolvedRequest) -> Schedule:
        """The noise schedule of a resolved request (models/schedules.py)."""
        return schedule_for(request, self.scheduler_config)

    @property
    def spatial_stride(self) -> int:
        return self.vae_scale_spatial * max(self.patch_size[1], self.patch_size[2])

    def latent_shape(self, request: ResolvedRequest) -> tuple[int, int, int, int, int]:
        """(batch, channels, latent frames, latent rows, latent columns) of a resolved request."""
        return (
            1,
            self.latent_channels,
            (request.num_frames - 1) // self.vae_scale_temporal + 1,
            request.height // self.vae_scale_spatial,
            request.width // self.vae_scale_spatial,
        )

    def resolve_request(self, request: GenerationRequest, *, read_image: bool = True) -> ResolvedRequest:
        """The request resolved against this model, once: unset fields filled with the model's defaults, and what
        depends on the model checked (ConfigError, naming the family where the request does not fit it).
        `read_image`: read the image (a file path: from this node's disk) into a uint8 RGB array, and size the
        request by it where the family does so; False checks only whether the family takes one."""
        self._check_family_inputs(request)
        request, defaults = fill_schedule(request, self.defaults)
        if self.family.experts == 2 and request.guidance_scale is not None:
            defaults["guidance_scale_2"] = request.guidance_scale  # as diffusers: the low-noise expert's follows it
        filled = dataclasses.replace(request, **{k: v for k, v in defaults.items() if getattr(request, k, 0) is None})
        filled.validate()
        resolved = ResolvedRequest.of(filled, experts=self.family.experts)
        self._check_strides(resolved)
        schedule = self.schedule(resolved)  # checks the schedule options against the checkpoint's scheduler
        resolved = resolve_cache(resolved, self.cache_ratios, schedule.key(), self.path)
        n = resolved.naming
        if resolved.cache != "none" and self.family.cache_points is None:
            raise ConfigError(
                f"{n.subject('cache', resolved.cache)}: {self.path.name} is {self.family.name}, whose blocks the step "
                f"cache does not serve yet (the family declares no cache points); drop {n.label('cache')} (or give "
                f"{n.setting('cache', 'none')})",
                param="cache",
            )
        if read_image and resolved.image is not None:
            resolved = resolved.read_image()
            sized = self.family.size_for_image
            if sized is not None and request.height is None and request.width is None:
                rows, cols = resolved.image.shape[:2]
                height, width = sized(rows, cols, self.transformer_config)
                resolved = dataclasses.replace(resolved, height=height, width=width)
        return resolved

    def _check_strides(self, request: ResolvedRequest) -> None:
        """The size and frame count the VAE and the patch size stride."""
        n = request.naming
        for name in ("height", "width"):
            value = getattr(request, name)
            if value % self.spatial_stride:
                lower = max(self.spatial_stride, value // self.spatial_stride * self.spatial_stride)
                raise ConfigError(
                    f"{n.subject(name, value)} must be a multiple of {self.spatial_stride} for this model (VAE factor "
                    f"{self.vae_scale_spatial} x patch size {self.patch_size[1]}); try {lower} or "
                    f"{lower + self.spatial_stride}",
                    param=name,
                )
        k = self.vae_scale_temporal
        if (request.num_frames - 1) % k:
            lower = (request.num_frames - 1) // k * k + 1
            raise ConfigError(
                f"{n.subject('num_frames', request.num_frames)} must be of the form {k}k+1 for this model (its VAE "
                f"packs {k} frames into one latent frame after the first); try {lower} or {lower + k}",
                param="num_frames",
            )

    def _check_family_inputs(self, request: GenerationRequest) -> None:
        family, n = self.family, request.naming
        what = f"{self.path.name} is {family.name} ({self.class_name})"
        if request.image is not None and family.image == IMAGE_NONE:
            raise ConfigError(
                f"{n.label('image')}: {what}, a text-to-video model that takes no image; drop {n.label('image')}, or "
                f"use an image-to-video checkpoint ({', '.join(f.name for f in registered_families() if f.takes_image)})",
                param="image",
            )
        if request.image is None and family.image == IMAGE_REQUIRED:
            how = {"flag": "--image PATH", "keyword": "image= (a path, a PIL image or a uint8 array)"}
            raise ConfigError(
                f"{n.label('image')}: {what}, an image-to-video model: pass the first frame as "
                f"{how.get(n.style, n.label('image'))}",
                param="image",
            )
        for name in ("guidance_scale_2", "boundary_ratio"):
            if getattr(request, name) is not None and family.experts == 1:
                raise ConfigError(
                    f"{n.label(name)}: {what}, which has one transformer; {name} applies to the two-expert models "
                    f"only ({', '.join(f.name for f in registered_families() if f.experts == 2)}): drop it",
                    param=name,
                )


def read_checkpoint_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--model: {path.parent} is not a diffusers checkpoint: {what} {path.name} is missing"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        fix = "fix it" if path.name == DEFAULTS_FILE else "re-download the checkpoint (or that file)"
        raise ConfigError(f"--model: {path} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--model: {path} must hold a JSON object")
    return data


def _component_present(index: dict[str, Any], name: str) -> bool:
    """Whether model_index.json names a component: [library, class]; diffusers writes [null, null] for an absent
    optional one."""
    entry = index.get(name)
    return isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)


def supported_classes() -> tuple[str, ...]:
    """The `_class_name`s of the registered families, in registration order."""
    return tuple(dict.fromkeys(name for fam in registered_families() for name in fam.class_names))


def checkpoint_traits(index: dict[str, Any]) -> tuple[int, bool, bool]:
    """(experts, expand_timesteps, image encoder) as a checkpoint's model_index.json says them."""
    experts = 2 if _component_present(index, "transformer_2") else 1
    return experts, bool(index.get("expand_timesteps") or False), _component_present(index, "image_encoder")


def family_for(class_name: str, index: dict[str, Any] | None = None) -> ModelFamily:
    """The family of a checkpoint: its `_class_name` and the traits its model_index.json shows."""
    candidates = [fam for fam in registered_families() if class_name in fam.class_names]
    if not candidates:
        raise ConfigError(
            f"--model: model_index.json has _class_name={class_name!r}, which distvideo does not run yet; "
            f"supported: {', '.join(supported_classes())}"
        )
    traits = checkpoint_traits(index or {})
    for fam in candidates:
        if fam.traits == traits:
            return fam
    experts, expand, encoder = traits
    raise ConfigError(
        f"--model: a {class_name} with {experts} transformer(s), expand_timesteps={expand} and "
        f"{'a' if encoder else 'no'} image encoder is no family distvideo knows; {class_name} checkpoints it runs: "
        + "; ".join(f"{fam.name} ({_traits_text(fam)})" for fam in candidates)
    )


def _traits_text(fam: ModelFamily) -> str:
    return (
        f"{fam.experts} transformer(s), expand_timesteps={fam.expand_timesteps}, "
        f"{'an' if fam.image_encoder else 'no'} image encoder"
    )


def probe_model(path: str | Path) -> ModelInfo:
    """Read a checkpoint folder's JSON files and return what is needed before loading weights."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(f"--model {path}: no such folder; pass a diffusers-format checkpoint folder or a repo id")
    if not root.is_dir():
        raise ConfigError(f"--model {path}: not a folder; pass a diffusers-format checkpoint folder")
    if not (root / "model_index.json").is_file():
        example = next((f.example_checkpoint for f in registered_families() if f.example_checkpoint), "<repo id>")
        raise ConfigError(
            f"--model {path}: not a diffusers checkpoint (no model_index.json); download one with e.g. "
            f"`hf download {example} --local-dir <folder>`"
        )
    index = read_checkpoint_json(root / "model_index.json", "file")
    class_name = index.get("_class_name")
    if not isinstance(class_name, str):
        raise ConfigError(f"--model {path}: model_index.json has no _class_name")
    family = family_for(class_name, index)
    for comp in family.components:
        if not _component_present(index, comp):
            raise ConfigError(f"--model {path}: model_index.json lacks the component '{comp}' ([library, class])")
        if not (root / comp).is_dir():
            raise ConfigError(f"--model {path}: component folder '{comp}/' is missing")
    vae_cfg = read_checkpoint_json(root / "vae" / "config.json", "VAE config")
    tr_cfgs = [read_checkpoint_json(root / name / "config.json", f"{name} config") for name in family.transformers]
    scale_spatial, scale_temporal = _vae_factors(vae_cfg)
    patch = _patch_size(tr_cfgs[0])
    defaults = _family_defaults(family, index, root, tr_cfgs[0])
    if (root / DEFAULTS_FILE).is_file():
        extra = read_checkpoint_json(root / DEFAULTS_FILE, "defaults")
        unknown = set(extra) - set(defaults) - set(CACHE_DEFAULT_KEYS) - set(SCHEDULE_KEYS)
        if unknown:
            raise ConfigError(f"--model {path}: {DEFAULTS_FILE} has unknown keys {sorted(unknown)}")
        _check_declared_schedule(root / DEFAULTS_FILE, extra)
        defaults.update(extra)
    noise_channels = vae_cfg.get("z_dim", 16) if family.image != IMAGE_NONE else tr_cfgs[0].get("in_channels", 16)
    if "latent_channels" in vae_cfg:  # HunyuanVideo 1.5: the transformer also takes condition latents and a mask
        noise_channels = vae_cfg["latent_channels"]
    return ModelInfo(
        path=root.resolve(),
        class_name=class_name,
        family=family,
        index=index,
        vae_scale_spatial=scale_spatial,
        vae_scale_temporal=scale_temporal,
        patch_size=(patch[0], patch[1], patch[2]),
        num_attention_heads=math.gcd(*(int(cfg.get("num_attention_heads", 1)) for cfg in tr_cfgs)),
        latent_channels=int(noise_channels),
        defaults=defaults,
        transformer_config=tr_cfgs[0],
        vae_config=vae_cfg,
        cache_ratios=read_ratios(root),
        scheduler_config=read_checkpoint_json(root / "scheduler" / "scheduler_config.json", "scheduler config"),
    )


def _check_declared_schedule(path: Path, declared: dict[str, Any]) -> None:
    """A checkpoint's declared schedule is checked like a request's (its errors name the file's keys)."""
    fields = {k: declared[k] for k in (*SCHEDULE_KEYS, "num_inference_steps") if k in declared}
    given = {k: f"--model: {path}: {k}" for k in fields}
    check_schedule_fields(GenerationRequest(prompt="-", **fields, naming=Naming("keyword", given)))


def _vae_factors(vae_cfg: dict[str, Any]) -> tuple[int, int]:
    """(spatial, temporal) compression of a VAE config: Wan's keys, or HunyuanVideo 1.5's ``*_compression_ratio``."""
    if "spatial_compression_ratio" in vae_cfg:
        return int(vae_cfg["spatial_compression_ratio"]), int(vae_cfg.get("temporal_compression_ratio", 4))
    temporal = vae_cfg.get("temperal_downsample", [False, True, True])
    scale_temporal = int(vae_cfg.get("scale_factor_temporal", 2 ** sum(bool(x) for x in temporal)))
    return int(vae_cfg.get("scale_factor_spatial", 2 ** len(temporal))), scale_temporal


def _patch_size(tr_cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(frames, rows, columns) of a transformer's patch: Wan's triple, or an int with ``patch_size_t`` (HunyuanVideo)."""
    patch = tr_cfg.get("patch_size", (1, 2, 2))
    if isinstance(patch, int):
        return int(tr_cfg.get("patch_size_t", 1)), patch, patch
    p_t, p_h, p_w = (int(x) for x in patch)
    return p_t, p_h, p_w


def _family_defaults(
    family: ModelFamily, index: dict[str, Any], root: Path, transformer: dict[str, Any]
) -> dict[str, Any]:
    """The family's documented request defaults, with what the checkpoint itself says (a two-expert model's
    boundary_ratio; whatever the family reads from its own files, such as HunyuanVideo's guider and target size)."""
    defaults = dict(family.defaults)
    ratio = index.get("boundary_ratio")
    if family.experts == 2 and isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        defaults["boundary_ratio"] = float(ratio)
    if family.checkpoint_defaults is not None:
        defaults.update(family.checkpoint_defaults(root, index, transformer))
    return defaults
