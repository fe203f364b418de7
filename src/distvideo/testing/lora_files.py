"""Random low-rank LoRA files for a checkpoint, in each published key layout: for tests, benchmarks and examples.

``random_lora_layers(model_dir, rank=4, seed=0)`` draws ``{diffusers layer name: (down, up)}``;
``save_lora_file(path, layers, layout="wan", alpha=2.0)`` writes them in a layout (``LAYOUTS``);
``build_random_lora(model_dir, path, layout="diffusers")`` does both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from distvideo.lora.formats import WAN_ATTENTION_NAMES, WAN_FIXED_NAMES

LAYOUTS = ("diffusers", "diffusers-bare", "wan", "musubi")

# the inverse of formats.diffusers_layer_name for the block layers (enough to write test files)
_TO_WAN_ATTENTION = {diffusers: wan for wan, diffusers in WAN_ATTENTION_NAMES.items()}
_DIFFUSERS_BLOCK_ATTENTION = re.compile(
    r"blocks\.(\d+)\.(attn1|attn2)\.(" + "|".join(re.escape(n) for n in _TO_WAN_ATTENTION) + ")"
)
_DIFFUSERS_BLOCK_FFN = re.compile(r"blocks\.(\d+)\.ffn\.(net\.0\.proj|net\.2)")
_TO_WAN_FIXED = {diffusers: wan for wan, diffusers in WAN_FIXED_NAMES.items()}


def wan_layer_name(name: str) -> str:
    """The original Wan name of a diffusers WanTransformer3DModel linear layer (``blocks.0.attn1.to_q`` ->
    ``blocks.0.self_attn.q``)."""
    m = _DIFFUSERS_BLOCK_ATTENTION.fullmatch(name)
    if m:
        return f"blocks.{m[1]}.{'self_attn' if m[2] == 'attn1' else 'cross_attn'}.{_TO_WAN_ATTENTION[m[3]]}"
    m = _DIFFUSERS_BLOCK_FFN.fullmatch(name)
    if m:
        return f"blocks.{m[1]}.ffn.{'0' if m[2] == 'net.0.proj' else '2'}"
    if name in _TO_WAN_FIXED:
        return _TO_WAN_FIXED[name]
    raise ValueError(f"no Wan name known for layer {name!r}")


def linear_shapes(model_dir: str | Path) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every linear layer of a checkpoint's transformer, read from the file header."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, int]] = {}
    for file in sorted((Path(model_dir) / "transformer").glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                if key.endswith(".weight") and len(shape) == 2:  # Wan's only 2-D weights are nn.Linear's
                    shapes[key[: -len(".weight")]] = (int(shape[0]), int(shape[1]))
    return shapes


def random_lora_layers(
    model_dir: str | Path,
    *,
    rank: int = 4,
    seed: int = 0,
    magnitude: float = 0.5,
    pattern: str = r"blocks\..*",
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random (down, up) pairs for the linear layers whose names match `pattern`; up @ down has entries of about
    `magnitude` / sqrt(in_features), i.e. `magnitude` times the size of the base weights of the tiny checkpoints."""
    gen = torch.Generator("cpu").manual_seed(seed)
    layers = {}
    for name, (out_f, in_f) in sorted(linear_shapes(model_dir).items()):
        if not re.fullmatch(pattern, name):
            continue
        down = torch.randn(rank, in_f, generator=gen) / in_f**0.5
        up = torch.randn(out_f, rank, generator=gen) * magnitude / rank**0.5
        layers[name] = (down, up)
    return layers


def lora_keys(name: str, layout: str) -> tuple[str, str, str]:
    """The (down, up, alpha) keys of layer `name` (diffusers naming) in a file of the given layout."""
    if layout == "diffusers":
        return f"transformer.{name}.lora_A.weight", f"transformer.{name}.lora_B.weight", f"transformer.{name}.alpha"
    if layout == "diffusers-bare":
        return f"{name}.lora_A.weight", f"{name}.lora_B.weight", f"{name}.alpha"
    wan = wan_layer_name(name)
    if layout == "wan":
        base = f"diffusion_model.{wan}"
    elif layout == "musubi":
        base = "lora_unet_" + wan.replace(".", "_")
    else:
        raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")
    return f"{base}.lora_down.weight", f"{base}.lora_up.weight", f"{base}.alpha"


def save_lora_file(
    path: str | Path,
    layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    layout: str = "diffusers",
    alpha: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `layers` ({diffusers layer name: (down, up)}) as a LoRA .safetensors file in `layout`; `alpha`, when
    given, is stored per layer (the update is then scaled by alpha / rank)."""
    from safetensors.torch import save_file

    tensors = {}
    for name, (down, up) in layers.items():
        down_key, up_key, alpha_key = lora_keys(name, layout)
        tensors[down_key] = down.to(dtype).contiguous().clone()  # clones: safetensors refuses shared storage
        tensors[up_key] = up.to(dtype).contiguous().clone()
        if alpha is not None:
            tensors[alpha_key] = torch.tensor(float(alpha))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    return out


def build_random_lora(
    model_dir: str | Path,
    path: str | Path,
    *,
    layout: str = "diffusers",
    rank: int = 4,
    seed: int = 0,
    alpha: float | None = None,
    magnitude: float = 0.5,
    pattern: str = r"blocks\..*",
) -> Path:
    """A random LoRA file for the checkpoint at `model_dir` (see random_lora_layers and save_lora_file)."""
    layers = random_lora_layers(model_dir, rank=rank, seed=seed, magnitude=magnitude, pattern=pattern)
    return save_lora_file(path, layers, layout=layout, alpha=alpha)
