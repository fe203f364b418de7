"""LoRA files as people publish them for Wan: reading a .safetensors file and naming its tensors the way diffusers'
WanTransformer3DModel names its layers.

Three key layouts are understood, all normalised to `{diffusers layer name: LoraLayerWeights}`:

- diffusers / PEFT: ``[transformer.]blocks.0.attn1.to_q.lora_A.weight`` / ``lora_B.weight`` [/ ``.alpha``];
- the original Wan code (as trained by DiffSynth, lightx2v and others):
  ``diffusion_model.blocks.0.self_attn.q.lora_down.weight`` / ``lora_up.weight`` / ``.alpha``, with Wan's layer names
  (``self_attn.q`` -> ``attn1.to_q``, ``ffn.0`` -> ``ffn.net.0.proj``, ``head.head`` -> ``proj_out``, ...);
- musubi-tuner: ``lora_unet_blocks_0_self_attn_q.lora_down.weight`` (Wan names with underscores).

Bias deltas (``.diff_b``, ``lora_B.bias``) and full weight deltas (``.diff``) of linear layers are applied too; deltas
of normalisation layers are skipped, as diffusers skips them (published files carry zeros there).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from distvideo.errors import LoraError
from distvideo.paths import resolve_lora_path

logger = logging.getLogger(__name__)


# Outer prefixes, longest first: PEFT's wrapper, ComfyUI-style, Wan's own, diffusers' component name.
_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.")
_MUSUBI_PREFIX = "lora_unet_"

# key suffix -> which tensor of the layer it is
_SUFFIXES = (
    (".lora_A.weight", "down"),
    (".lora_down.weight", "down"),
    (".lora_B.weight", "up"),
    (".lora_up.weight", "up"),
    (".lora_B.bias", "bias"),
    (".diff_b", "bias"),
    (".diff", "diff"),
    (".alpha", "alpha"),
)

WAN_ATTENTION_NAMES = {
    "q": "to_q",
    "k": "to_k",
    "v": "to_v",
    "o": "to_out.0",
    "k_img": "add_k_proj",
    "v_img": "add_v_proj",
}
_WAN_BLOCK_ATTENTION = re.compile(r"blocks\.(\d+)\.(self_attn|cross_attn)\.(q|k|v|o|k_img|v_img)")
_WAN_BLOCK_FFN = re.compile(r"blocks\.(\d+)\.ffn\.(0|2)")
WAN_FIXED_NAMES = {
    "head.head": "proj_out",
    "time_projection.1": "condition_embedder.time_proj",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
}
_MUSUBI_BLOCK = re.compile(r"blocks_(\d+)_(self_attn|cross_attn)_(q|k|v|o|k_img|v_img)|blocks_(\d+)_ffn_(0|2)")


@dataclass
class LoraLayerWeights:
    """The tensors a file holds for one linear layer (float32, on the CPU).

    The layer's weight changes by ``strength * (alpha / rank * up @ down + diff)`` and its bias by
    ``strength * bias``; alpha defaults to the rank (scale 1), as in diffusers and PEFT.
    """

    down: torch.Tensor | None = None  # (rank, in_features): lora_A / lora_down
    up: torch.Tensor | None = None  # (out_features, rank): lora_B / lora_up
    alpha: float | None = None
    diff: torch.Tensor | None = None  # (out_features, in_features): a full weight delta
    bias: torch.Tensor | None = None  # (out_features,): a bias delta

    @property
    def rank(self) -> int:
        return int(self.down.shape[0]) if self.down is not None else 0

    @property
    def scale(self) -> float:
        """alpha / rank: the factor on up @ down at strength 1."""
        if self.down is None:
            return 1.0
        return (self.alpha if self.alpha is not None else self.rank) / self.rank


@dataclass
class LoraFile:
    """A parsed LoRA file: its layers under diffusers' names, the key layout seen, and a digest of its bytes."""

    path: str
    layers: dict[str, LoraLayerWeights]
    layout: str
    sha256: str
    skipped: list[str]


def diffusers_layer_name(name: str) -> str:
    """The diffusers WanTransformer3DModel name of a layer named the Wan way (``blocks.0.self_attn.q`` ->
    ``blocks.0.attn1.to_q``); names already in diffusers' scheme come back unchanged."""
    m = _WAN_BLOCK_ATTENTION.fullmatch(name)
    if m:
        attn = "attn1" if m[2] == "self_attn" else "attn2"
        return f"blocks.{m[1]}.{attn}.{WAN_ATTENTION_NAMES[m[3]]}"
    m = _WAN_BLOCK_FFN.fullmatch(name)
    if m:
        return f"blocks.{m[1]}.ffn.{'net.0.proj' if m[2] == '0' else 'net.2'}"
    return WAN_FIXED_NAMES.get(name, name)


def _musubi_to_wan(name: str) -> str:
    """``blocks_0_self_attn_q`` -> ``blocks.0.self_attn.q``; other names come back unchanged."""
    m = _MUSUBI_BLOCK.fullmatch(name)
    if m is None:
        return name
    if m[1] is not None:
        return f"blocks.{m[1]}.{m[2]}.{m[3]}"
    return f"blocks.{m[4]}.ffn.{m[5]}"


def split_key(key: str) -> tuple[str, str] | None:
    """A file key -> (diffusers layer name, tensor kind), or None when the key is not a LoRA tensor we know."""
    name = key
    musubi = name.startswith(_MUSUBI_PREFIX)
    if musubi:
        name = name[len(_MUSUBI_PREFIX) :]
    else:
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
    for suffix, kind in _SUFFIXES:
        if name.endswith(suffix):
            layer = name[: -len(suffix)]
            if musubi:
                layer = _musubi_to_wan(layer)
            return diffusers_layer_name(layer), kind
    return None


def key_layout(keys: list[str]) -> str:
    """A short name for the key layout of a file, for messages."""
    if any(k.startswith(_MUSUBI_PREFIX) for k in keys):
        return "musubi-tuner (lora_unet_...)"
    if any(k.startswith(("diffusion_model.", "model.diffusion_model.")) for k in keys):
        return "Wan (diffusion_model....lora_down/lora_up)"
    return "diffusers/PEFT (...lora_A/lora_B)"


def read_lora_file(path: str | Path) -> LoraFile:
    """Read and parse a LoRA .safetensors file (not yet checked against a model)."""
    from safetensors.torch import load as load_safetensors

    file = resolve_lora_path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise LoraError(f"LoRA file {str(file)!r} cannot be read: {exc}") from None
    try:
        tensors = load_safetensors(data)
    except Exception as exc:
        hint = "" if file.suffix == ".safetensors" else " Only .safetensors LoRA files are supported."
        raise LoraError(
            f"LoRA file {str(file)!r} is not a valid .safetensors file ({type(exc).__name__}: {exc}); "
            f"it may be truncated or corrupt: download it again.{hint}"
        ) from None
    if not tensors:
        raise LoraError(f"LoRA file {str(file)!r} holds no tensors")
    layers, skipped = parse_lora_state_dict(tensors, source=str(file))
    return LoraFile(
        path=str(file),
        layers=layers,
        layout=key_layout(list(tensors)),
        sha256=hashlib.sha256(data).hexdigest(),
        skipped=skipped,
    )


def parse_lora_state_dict(
    tensors: Mapping[str, torch.Tensor], *, source: str = "<state dict>"
) -> tuple[dict[str, LoraLayerWeights], list[str]]:
    """Group a LoRA state dict by layer (diffusers names). Returns the layers and the keys skipped on purpose
    (normalisation-layer deltas); keys of unknown shape are reported when checked against the model."""
    layers: dict[str, LoraLayerWeights] = {}
    unknown: list[str] = []
    skipped: list[str] = []
    for key, tensor in tensors.items():
        parsed = split_key(key)
        if parsed is None:
            unknown.append(key)
            continue
        layer, kind = parsed
        if kind in ("diff", "bias") and "norm" in layer.rsplit(".", 1)[-1]:
            skipped.append(key)  # diffusers drops these too: published files hold zeros there
            continue
        weights = layers.setdefault(layer, LoraLayerWeights())
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise LoraError(
                f"LoRA file {source!r}: {key} holds NaN or infinite values; the adapter would turn every frame into "
                "noise or black. The file is corrupt or was saved from a diverged training run."
            )
        if kind == "alpha":
            if tensor.numel() != 1:
                raise LoraError(
                    f"LoRA file {source!r}: {key} should be a single number, has shape {tuple(tensor.shape)}"
                )
            weights.alpha = float(tensor.float().item())
        else:
            setattr(weights, kind, tensor.detach().to(torch.float32))
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise LoraError(
            f"LoRA file {source!r}: {len(unknown)} key(s) are not LoRA tensors distvideo knows: {shown}. Expected keys "
            "like transformer.blocks.0.attn1.to_q.lora_A.weight (diffusers/PEFT) or "
            "diffusion_model.blocks.0.self_attn.q.lora_down.weight (Wan). DoRA and LoKr files are not supported."
        )
    if skipped:
        logger.debug("LoRA file %s: skipped %d normalisation-layer delta(s)", source, len(skipped))
    for layer, weights in layers.items():
        if (weights.down is None) != (weights.up is None):
            have, missing = ("down (lora_A)", "up (lora_B)") if weights.up is None else ("up (lora_B)", "down (lora_A)")
            raise LoraError(f"LoRA file {source!r}: layer {layer} has a {have} matrix but no {missing} matrix")
        if weights.down is None and weights.diff is None and weights.bias is None:
            raise LoraError(f"LoRA file {source!r}: layer {layer} has an alpha but no LoRA matrices")
        if weights.down is not None and weights.up is not None:
            down, up = weights.down, weights.up
            if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1] or down.shape[0] == 0:
                raise LoraError(
                    f"LoRA file {source!r}: layer {layer} has lora_A of shape {tuple(down.shape)} and lora_B "
                    f"of shape {tuple(up.shape)}; expected (rank, in_features) and (out_features, rank) with the same "
                    "rank of at least 1"
                )
    return layers, skipped
