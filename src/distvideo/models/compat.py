"""Every private name of diffusers, torch and Ray that distvideo relies on, in one module, with a version check.

The plans (Ulysses, banded decode, text padding, CPU kernels) change diffusers' Wan modules in place. Where
diffusers offers a public way (hooks, ``set_processor``) they use it; what remains private is reached only through
the functions below, so a diffusers or torch upgrade that renames something breaks here, in one file, with a message
naming the installed version. ``check_private_names()`` runs when the first plan is applied.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: diffusers releases the plans were tested with (inclusive, by minor version); others are checked name by name.
TESTED_DIFFUSERS = ((0, 35), (0, 42))

_HV15_PIPELINE = "diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5"
_HV15_I2V_PIPELINE = "diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video"
# module -> the private (or deep, unexported) names taken from it
_DIFFUSERS_NAMES = {
    "diffusers.models.transformers.transformer_wan": ("_get_qkv_projections", "WanAttnProcessor"),
    "diffusers.models.attention_dispatch": ("dispatch_attention_fn",),
    "diffusers.models.autoencoders.autoencoder_kl_wan": ("WanCausalConv3d", "WanAttentionBlock", "WanRMS_norm"),
    "diffusers.pipelines.wan.pipeline_wan": ("prompt_clean",),
}
# attributes of diffusers objects read or written: (module, class, attribute). HunyuanVideo 1.5's pipeline attributes
# are checked where they are taken (hunyuan15_text_encoders, hunyuan15_image_encoders): importing its image-to-video
# module imports transformers' SigLIP image processor, which warns about torchvision on every Wan run otherwise
_DIFFUSERS_ATTRIBUTES = (
    ("diffusers.models.transformers.transformer_wan", "WanAttnProcessor", "_attention_backend"),
    ("diffusers.models.transformers.transformer_wan", "WanAttnProcessor", "_parallel_config"),
)


class UnsupportedLibraryError(RuntimeError):
    """An installed diffusers or torch lacks a private name distvideo's plans need."""


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


@functools.lru_cache(maxsize=1)
def check_private_names() -> None:
    """Raise UnsupportedLibraryError naming the diffusers/torch version and the missing name when a private name
    this module maps is gone; log once when diffusers is outside the tested range but everything is present."""
    import importlib

    import diffusers

    version = diffusers.__version__
    missing = []
    for module_name, names in _DIFFUSERS_NAMES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        missing += [f"{module_name}.{name}" for name in names if not hasattr(module, name)]
    for module_name, cls_name, attribute in _DIFFUSERS_ATTRIBUTES:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name, None)
        except ImportError:
            missing.append(module_name)
            continue
        if cls is not None and not hasattr(cls, attribute):
            missing.append(f"{module_name}.{cls_name}.{attribute}")
    if not hasattr(nn.Conv3d, "_conv_forward"):
        missing.append(f"torch.nn.Conv3d._conv_forward (torch {torch.__version__})")
    if not hasattr(nn.Module, "_compiled_call_impl"):
        missing.append(f"torch.nn.Module._compiled_call_impl (torch {torch.__version__})")
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        missing.append(f"torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (torch {torch.__version__})")
    if missing:
        raise _unsupported(missing)
    if not TESTED_DIFFUSERS[0] <= _version_tuple(version) <= TESTED_DIFFUSERS[1]:
        logger.warning(
            "diffusers %s is outside the versions distvideo was tested with; its private names are present", version
        )


def _unsupported(missing: list[str]) -> UnsupportedLibraryError:
    import diffusers

    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_DIFFUSERS
    return UnsupportedLibraryError(
        f"diffusers {diffusers.__version__} lacks what distvideo's plans use: {', '.join(missing)}. distvideo is "
        f"tested with diffusers {lo_major}.{lo_minor} to {hi_major}.{hi_minor}: install one of those, e.g. "
        f"pip install 'diffusers>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}'"
    )


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """transformers' own warnings (its verbosity) at error level for the block."""
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(level)


def _static_methods(module_name: str, cls_name: str, *names: str) -> tuple[Callable[..., Any], ...]:
    """The named attributes of a diffusers class, or UnsupportedLibraryError naming each one that is missing."""
    import importlib

    try:
        with _transformers_quiet():  # its image processor's torchvision fallback: nothing a user need act on
            cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError):
        raise _unsupported([f"{module_name}.{cls_name}"]) from None
    missing = [f"{module_name}.{cls_name}.{name}" for name in names if not hasattr(cls, name)]
    if missing:
        raise _unsupported(missing)
    return tuple(getattr(cls, name) for name in names)


# --- diffusers: Wan transformer -------------------------------------------------------------------------------------
def wan_qkv_projections(attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any) -> Any:
    """(query, key, value) projections of a Wan attention module, as diffusers' WanAttnProcessor computes them
    (fused projections included)."""
    from diffusers.models.transformers.transformer_wan import _get_qkv_projections

    return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)


def dispatch_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    backend: Any,
    *,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """diffusers' attention dispatcher (the backend a processor was configured with), no dropout."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(
        query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=False, backend=backend
    )


def attention_backend(processor: Any) -> Any:
    """The attention backend a diffusers processor was set to (None: diffusers' default)."""
    return getattr(processor, "_attention_backend", None)


#: Class attributes a processor of ours declares so diffusers treats it like its own Wan processors: the attention
#: backend it dispatches to, and no diffusers context parallelism (ours replaces it).
PROCESSOR_PROTOCOL_ATTRIBUTES = {"_attention_backend": None, "_parallel_config": None}


# --- diffusers: Wan VAE ---------------------------------------------------------------------------------------------
def wan_vae_classes() -> tuple[Any, Any]:
    """(WanCausalConv3d, WanAttentionBlock): the decoder modules the banded decode patches or hooks."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanCausalConv3d

    return WanCausalConv3d, WanAttentionBlock


def causal_conv_padding(conv: Any) -> tuple[int, int, int, int, int, int]:
    """A WanCausalConv3d's padding as F.pad takes it: (left, right, top, bottom, frames before, frames after)."""
    w1, w2, h1, h2, t1, t2 = (int(p) for p in conv._padding)
    return w1, w2, h1, h2, t1, t2


def is_channel_rms_norm(module: nn.Module) -> bool:
    """Whether `module` is diffusers' channel RMS norm that cpu_kernels speeds up: WanRMS_norm (the Wan VAE's)."""
    return type(module).__name__ == "WanRMS_norm"


def rms_norm_parts(norm: Any) -> tuple[int, float, torch.Tensor, Any]:
    """(normalised dim, scale, gamma, bias) of a WanRMS_norm: its output is F.normalize(x, dim) * scale * gamma
    + bias."""
    return (1 if norm.channel_first else -1), norm.scale, norm.gamma, norm.bias


def prompt_clean(text: str) -> str:
    """diffusers' Wan prompt cleaning (ftfy when installed, HTML unescape, whitespace), for parity with WanPipeline."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as clean

    return clean(text)


def hunyuan15_text_encoders() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """diffusers' HunyuanVideo 1.5 text encodings, its pipeline's static ``_get_mllm_prompt_embeds`` (Qwen2.5-VL over
    the chat template, the system prompt cropped) and ``_get_byt5_prompt_embeds`` (the quoted glyph texts through
    ByT5), for parity with HunyuanVideo15Pipeline."""
    mllm, byt5 = _static_methods(
        _HV15_PIPELINE, "HunyuanVideo15Pipeline", "_get_mllm_prompt_embeds", "_get_byt5_prompt_embeds"
    )
    return mllm, byt5


def hunyuan15_image_encoders() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """diffusers' HunyuanVideo 1.5 image conditioning, its image-to-video pipeline's static ``_get_image_latents``
    (the VAE's mode of the resized image, times the scaling factor) and ``_get_image_embeds`` (SigLIP's tokens)."""
    latents, embeds = _static_methods(
        _HV15_I2V_PIPELINE, "HunyuanVideo15ImageToVideoPipeline", "_get_image_latents", "_get_image_embeds"
    )
    return latents, embeds


# --- torch ----------------------------------------------------------------------------------------------------------
def conv_forward(conv: nn.Conv3d) -> Callable[..., torch.Tensor]:
    """The convolution's ``_conv_forward(x, weight, bias)``, bound to it."""
    return conv._conv_forward


def patch_conv_forward(conv: nn.Conv3d, forward: Callable[..., torch.Tensor]) -> Callable[[], None]:
    """Replace a convolution's ``_conv_forward(x, weight, bias)`` (which ``forward`` and wrappers that pad first
    call) on this instance; returns the undo."""
    conv._conv_forward = forward  # type: ignore[method-assign]
    return lambda: delattr(conv, "_conv_forward")


def conv_forward_is_patched(conv: nn.Conv3d) -> bool:
    return "_conv_forward" in vars(conv)


def tensor_version(x: torch.Tensor) -> int:
    """The version counter every in-place change of `x` bumps."""
    return int(x._version)


def abort_process_group() -> Callable[[], None] | None:
    """torch's abort of every process group (NCCL: returns without waiting on peers), or None when absent."""
    return getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)


def backend_options(backend: str, timeout: timedelta) -> Any:
    """Options of a `backend` process group that carry `timeout`, of the type `init_device_mesh`'s
    `backend_override` takes: ProcessGroupNCCL.Options has no timeout argument (new_group sets its `_timeout`), and
    the generic type is the private ``torch._C._distributed_c10d.Backend.Options``."""
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    from torch._C._distributed_c10d import Backend

    return Backend.Options(backend, timeout)


def compiled_modules(module: nn.Module) -> list[nn.Module]:
    """The submodules of `module` that ``nn.Module.compile()`` compiled (their ``_compiled_call_impl`` is set)."""
    return [m for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None]


def uncompile(module: nn.Module) -> None:
    """Undo ``nn.Module.compile()`` on `module` alone: its calls run the eager ``forward`` again."""
    module._compiled_call_impl = None


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (dynamo's frame compiles, which include inductor's code
    generation and its C++/Triton builds): torch._dynamo's cumulative ``entire_frame_compile`` (and backward) timer;
    ``torch._dynamo.reset()`` sets it back to 0. 0.0 when this torch has no such counter."""
    try:
        from torch._dynamo.utils import calculate_time_spent
    except ImportError:
        return 0.0
    return float(calculate_time_spent().get("total_wall_time", 0.0))


# --- attention that also returns its log-sum-exp (ring attention's blocks) ------------------------------------------
def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T / sqrt(D)) v, logsumexp of the scaled scores) for (B, S, H, D) tensors: the output (B, S_q, H, D)
    in float32 and the LSE (B, S_q, H) in float32. On CPU torch's private flash kernel (the one public
    `scaled_dot_product_attention` runs there, so a single block equals it bit for bit); on CUDA its private
    memory-efficient kernel, which returns the LSE; elsewhere plain torch math with float32 accumulation."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, S, D)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    elif q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
        lse = lse[..., : q.shape[2]]  # some releases pad the LSE's sequence to a multiple of 32
    else:
        scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.exp(scores - lse.unsqueeze(-1)) @ v.float()
    return out.transpose(1, 2).float(), lse.transpose(1, 2).float()


# --- Ray (the ray executor, executors/ray_placement.py) -----------------------------------------------------------
@contextlib.contextmanager
def ray_single_machine_mode() -> Iterator[None]:
    """While Ray starts or resolves a local cluster: keep its node address at 127.0.0.1. On Linux Ray turns a node
    address of 127.0.0.1 into the host's reachable one (`ray.util.get_node_ip_address()`), so GCS, raylet, agents and
    every worker would listen on all interfaces; its single-machine mode (`ray._private.ray_constants
    .ENABLE_RAY_CLUSTER` off, what RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 selects at import) keeps the address, and with
    it each server, on loopback. Private: the switch is only read as an environment variable when Ray is imported."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def ray_bootstrap_address(address: str | None) -> str | None:
    """The GCS address `ray.init(address)` would join, without connecting (`ray._private.services
    .canonicalize_bootstrap_address`, private: Ray has no public way to ask)."""
    from ray._private import services

    running: str | None = services.canonicalize_bootstrap_address(address)  # type: ignore[arg-type]
    return running


# --- torchao: imported when quantizing, not before ------------------------------------------------------------------
@functools.cache
def defer_torchao() -> None:
    """Keep diffusers and transformers from importing torchao when they load a model. Both import it eagerly wherever
    it is installed (diffusers to register its tensor types as safe to unpickle, transformers for its quantizer):
    about 0.4 CPU-seconds of every rank's start on a 2-core machine (most of torchao's own import, torch._dynamo,
    diffusers imports anyway), and warnings about its CUDA extensions on every rank of a CPU. distvideo loads
    only safetensors, refuses pre-quantized checkpoints (models/loading.py) and calls torchao itself when a mode
    asks for it (torchao_quantization), so neither library needs it. Called before the first model loads; a process
    whose libraries imported torchao already keeps it."""
    import diffusers.utils.import_utils as diffusers_imports
    import transformers.utils as transformers_utils
    import transformers.utils.import_utils as transformers_imports

    def unavailable(*args: Any, **kwargs: Any) -> bool:
        return False

    diffusers_imports._torchao_available = False
    transformers_imports.is_torchao_available = unavailable  # type: ignore[assignment]
    transformers_utils.is_torchao_available = unavailable  # type: ignore[assignment]


def torchao_quantization() -> Any:
    """``torchao.quantization``, imported without the warnings of its import on a machine without its CUDA kernels
    (extensions it fails to load, torch's notice about its enum registrations)."""
    import sys

    if "torchao.quantization" not in sys.modules:
        loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
        levels = [log.level for log in loggers]
        for log in loggers:
            log.setLevel(logging.ERROR)
        try:
            import torchao.quantization  # noqa: F401
        finally:
            for log, level in zip(loggers, levels, strict=True):
                log.setLevel(level)
    return sys.modules["torchao.quantization"]
