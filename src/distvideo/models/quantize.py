"""Low-precision weights (`quantize`, `quantize_text_encoder`) and the attention kernel (`attention`).

The modes (config.QUANTIZE_MODES), each from a library made for it, applied by the worker once, right after loading
and before any plan:

- ``int8``: torchao's ``Int8DynamicActivationInt8WeightConfig``: int8 weights with one scale per output row, the
  activations quantized per token at each call; the product runs as an int8 matrix product (``aten._int_mm``) on
  CPU and CUDA.
- ``int8-weight``: torchao's ``Int8WeightOnlyConfig``: int8 weights, the product in the compute dtype (memory).
- ``fp8``: torchao's ``Float8DynamicActivationFloat8WeightConfig`` with row-wise scales: float8 products on CUDA
  GPUs of compute capability 8.9 or newer; refused elsewhere before anything loads.
- ``fp8-weight``: diffusers' layerwise casting: weights stored in float8 (e4m3), each layer cast to the compute
  dtype for its own forward (memory, not speed; any device).

Which layers stay in full precision is the family's declaration (`ModelFamily.full_precision`, regular expressions
searched in the module names, as diffusers' layerwise casting reads them); text encoders keep their embeddings, norms
and output head. Only linear layers are quantized by the torchao modes.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distvideo.config import EngineConfig
from distvideo.errors import ConfigError
from distvideo.models import compat
from distvideo.models.family import ModelFamily

TORCHAO_MODES = ("int8", "int8-weight", "fp8")
#: the compute capability float8 matrix products need (Ada Lovelace, Hopper and newer)
FP8_CAPABILITY = (8, 9)
#: a text encoder's layers left in full precision: embeddings, norms, relative position biases, an output head
TEXT_ENCODER_FULL_PRECISION = ("embed", "shared", "norm", "relative_attention_bias", "lm_head")
#: the Python package behind each attention kernel
ATTENTION_PACKAGES = {"sage": "sageattention", "flash": "flash_attn"}
QUANTIZED = ("quantize", "quantize_text_encoder")


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@dataclass(frozen=True)
class DeviceKind:
    """What the ranks compute on, as far as the modes care: the device type and a CUDA GPU's compute capability."""

    type: str
    capability: tuple[int, int] | None = None

    @classmethod
    def of(cls, device: torch.device) -> DeviceKind:
        if device.type == "cuda":
            return cls("cuda", tuple(torch.cuda.get_device_capability(device)))  # type: ignore[arg-type]
        return cls(device.type)

    def describe(self) -> str:
        if self.capability is None:
            return self.type
        return f"{self.type} (compute capability {self.capability[0]}.{self.capability[1]})"


def check_support(config: EngineConfig, device: DeviceKind, *, has: Callable[[str], bool] = installed) -> None:
    """ConfigError naming the option when a quantization mode or attention kernel cannot run on `device` (or its
    library is not installed), before anything loads."""
    n = config.naming
    for name in QUANTIZED:
        mode = getattr(config, name)
        if mode in TORCHAO_MODES and not has("torchao"):
            raise ConfigError(
                f"{n.subject(name, mode)} needs torchao, which is not installed; pip install 'distvideo[quantize]' "
                "(or fp8-weight, which needs only diffusers)",
                param=name,
            )
        if mode == "fp8" and (device.type != "cuda" or (device.capability or (0, 0)) < FP8_CAPABILITY):
            raise ConfigError(
                f"{n.subject(name, mode)} needs float8 matrix products: a CUDA GPU of compute capability "
                f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell); the ranks run on "
                f"{device.describe()}. There, use int8 (int8 weights and activations), int8-weight, or fp8-weight "
                "(float8 storage, for memory)",
                param=name,
            )
        if mode == "fp8" and config.dtype not in (None, "bfloat16"):
            raise ConfigError(
                f"{n.subject(name, mode)} with {n.subject('dtype', config.dtype)}: float8 products with row-wise "
                f"scales take bfloat16 activations; leave {n.label('dtype')} unset (bfloat16 on a GPU) or use int8",
                param=name,
            )
    backend = config.attention or "sdpa"
    if backend != "sdpa":
        package = ATTENTION_PACKAGES[backend]
        if device.type != "cuda" or not has(package):
            why = f"the ranks run on {device.describe()}" if device.type != "cuda" else f"{package} is not installed"
            raise ConfigError(
                f"{n.subject('attention', backend)} needs a CUDA GPU and the {package} package ({why}); "
                f"{n.setting('attention', 'sdpa')} runs everywhere",
                param="attention",
            )
        if (config.ring_size or 1) > 1:
            raise ConfigError(
                f"{n.subject('attention', backend)} with {n.subject('ring_size', config.ring_size)}: ring attention "
                "merges partial results by their log-sum-exp, which distvideo computes with sdpa; use Ulysses "
                "(ring_size 1) or sdpa",
                param="attention",
            )


def keeps_full_precision(name: str, patterns: Iterable[str]) -> bool:
    return any(re.search(pattern, name) for pattern in patterns)


def _torchao_config(mode: str) -> Any:
    quantization = compat.torchao_quantization()
    if mode == "int8":
        return quantization.Int8DynamicActivationInt8WeightConfig()
    if mode == "int8-weight":
        return quantization.Int8WeightOnlyConfig()
    return quantization.Float8DynamicActivationFloat8WeightConfig(granularity=quantization.PerRow())


def quantize_module(module: nn.Module, mode: str, keep: tuple[str, ...], compute_dtype: torch.dtype) -> None:
    """Quantize `module` in place by `mode` (QUANTIZE_MODES but "none"), leaving the layers `keep` names alone."""
    if mode == "fp8-weight":
        from diffusers.hooks import apply_layerwise_casting

        apply_layerwise_casting(module, torch.float8_e4m3fn, compute_dtype, skip_modules_pattern=keep)
        return

    def chosen(layer: nn.Module, name: str) -> bool:
        return isinstance(layer, nn.Linear) and not keeps_full_precision(name, keep)

    compat.torchao_quantization().quantize_(module, _torchao_config(mode), filter_fn=chosen)


def _is_torchao(t: Any) -> bool:
    """Whether `t` is one of torchao's quantized tensor subclasses."""
    return type(t).__module__.startswith("torchao")


def is_low_precision(weight: Any) -> bool:
    """Whether a weight is held in low precision: a torchao quantized tensor, or float8 storage."""
    return _is_torchao(weight) or weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantized_modules(module: nn.Module) -> int:
    """How many of `module`'s layers hold their weight in low precision."""
    weights = (getattr(m, "weight", None) for m in module.modules())
    return sum(1 for w in weights if isinstance(w, torch.Tensor) and is_low_precision(w))


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: a tensor subclass (torchao's) its inner tensors', a plain tensor its elements'."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and _is_torchao(t):
        names, _ = flatten()
        return sum(tensor_bytes(inner) for inner in (getattr(t, n) for n in names) if inner is not None)
    return t.numel() * t.element_size()


def weight_bytes(module: nn.Module) -> int:
    """The bytes of `module`'s parameters and buffers on this rank."""
    return sum(tensor_bytes(t) for t in (*module.parameters(), *module.buffers()))


def quantize_components(
    components: dict[str, Any], family: ModelFamily, config: EngineConfig, dtypes: dict[str, torch.dtype]
) -> dict[str, dict[str, Any]]:
    """Quantize the denoising transformers by `config.quantize` and the text encoders by `config.quantize_text_encoder`
    (in place), and report every one of them: {component: {"mode", "quantized_modules", "bytes"}} (bytes of weights
    on this rank, as loaded and quantized)."""
    targets = {name: (config.quantize, family.full_precision) for name in family.transformers}
    for name in ("text_encoder", "text_encoder_2"):
        if name in components:
            targets[name] = (config.quantize_text_encoder, TEXT_ENCODER_FULL_PRECISION)
    report = {}
    for name, (mode, keep) in targets.items():
        module = components[name]
        if mode not in (None, "none"):
            quantize_module(module, mode, keep, dtypes.get(name, torch.float32))
        report[name] = {
            "mode": mode or "none",
            "quantized_modules": quantized_modules(module),
            "bytes": weight_bytes(module),
        }
    return report


def set_attention_backend(components: dict[str, Any], transformers: Iterable[str], backend: str) -> None:
    """Route the transformers' attention through diffusers' dispatcher to `backend` (sdpa: diffusers' default, left
    as loaded); the Ulysses processors take the backend over from the processors they replace."""
    if backend == "sdpa":
        return
    for name in transformers:
        components[name].set_attention_backend(backend)
