"""The parts every random-weight test checkpoint is built from (distvideo.testing.checkpoints: Wan2.1 T2V;
distvideo.testing.families: the other Wan families): a deterministic initialisation defined here (not the libraries'
own ``_init_weights``), the Wan2.1-shaped transformer, VAE and UMT5 text encoder, the schedulers the published
checkpoints ship, and stable JSON."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Per-channel latent statistics of the real Wan2.1 VAE; a tiny VAE with z_dim <= 16 uses the first z_dim entries.
WAN21_LATENTS_MEAN = [
    -0.7571,
    -0.7089,
    -0.9113,
    0.1075,
    -0.1745,
    0.9653,
    -0.1517,
    1.5508,
    0.4134,
    -0.0715,
    0.5517,
    -0.3632,
    -0.1922,
    -0.9497,
    0.2503,
    -0.2921,
]
WAN21_LATENTS_STD = [
    2.8184,
    1.4541,
    2.3275,
    2.6558,
    1.2196,
    1.7708,
    2.6052,
    2.0743,
    3.2687,
    2.1526,
    2.8652,
    1.5579,
    1.6382,
    1.1253,
    2.8251,
    1.9160,
]

# Seed offsets so the components draw from independent streams.
SEED_OFFSETS = {"transformer": 0, "vae": 1_000, "text_encoder": 2_000}

# Gain of the last decoder convolution: random-weight decoders otherwise produce values far outside [-1, 1], which the
# pipeline clamps, giving saturated (nearly binary) frames.
VAE_OUT_GAIN = 0.75


def init_weights(
    module: Any, seed: int, out_gain: dict[str, float] | None = None, device: str | torch.device = "cpu"
) -> None:
    """Overwrite every parameter of ``module`` from a generator seeded with ``seed``, drawn on `device` (where the
    module's parameters are; each device's generator has its own stream, so the weights depend on it).

    Linear/conv weights ~ N(0, 1/fan_in), their biases ~ N(0, 0.02^2), embeddings ~ N(0, 1), norm scales 1, norm
    shifts 0, ``scale_shift_table`` ~ N(0, 1/dim) as diffusers does. ``out_gain`` multiplies the weights of the named
    submodules. Parameters are visited in registration order, so the result depends only on the architecture.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    out_gain = out_gain or {}

    def randn(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=gen, dtype=torch.float32, device=device) * std

    with torch.no_grad():
        for mod_name, mod in module.named_modules():
            for name, param in mod.named_parameters(recurse=False):
                if isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                    if name == "weight":
                        fan_in = math.prod(param.shape[1:])
                        value = randn(param.shape, out_gain.get(mod_name, 1.0) / math.sqrt(fan_in))
                    else:
                        value = randn(param.shape, 0.02)
                elif isinstance(mod, nn.Embedding):
                    value = randn(param.shape, 1.0)
                elif name == "scale_shift_table":
                    value = randn(param.shape, 1.0 / math.sqrt(param.shape[-1]))
                elif name in ("weight", "gamma"):
                    value = torch.ones(param.shape, device=device)
                elif name in ("bias", "beta"):
                    value = torch.zeros(param.shape, device=device)
                else:
                    value = randn(param.shape, 0.02)
                param.copy_(value.to(param.dtype))


def build_transformer(
    *,
    num_layers: int,
    num_attention_heads: int,
    attention_head_dim: int,
    ffn_dim: int,
    text_dim: int,
    freq_dim: int,
    z_dim: int,
    seed: int,
    in_channels: int | None = None,
    image_dim: int | None = None,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A Wan transformer denoising `z_dim` latent channels from `in_channels` (default `z_dim`; more when a condition
    is stacked on the noise), with image cross-attention when `image_dim` (the image encoder's width) is given.
    With `device`, built in `dtype` on it by :func:`on_device` (for saving)."""
    from diffusers import WanTransformer3DModel

    head_split = 2 * (attention_head_dim // 6)
    if head_split == 0 or (attention_head_dim - 2 * head_split) % 2:
        raise ValueError(
            f"attention_head_dim={attention_head_dim} cannot be split into even t/h/w rotary parts; use a value "
            "with attention_head_dim // 6 >= 1 and an even remainder, e.g. 8, 12, 16, 64 or 128"
        )
    construct = lambda: WanTransformer3DModel(  # noqa: E731
        patch_size=(1, 2, 2),
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        in_channels=z_dim if in_channels is None else in_channels,
        out_channels=z_dim,
        text_dim=text_dim,
        freq_dim=freq_dim,
        ffn_dim=ffn_dim,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=image_dim,
        added_kv_proj_dim=num_attention_heads * attention_head_dim if image_dim is not None else None,
        rope_max_seq_len=1024,
    )
    if device is not None:
        return on_device(construct, seed=seed, device=device, dtype=dtype)
    model = construct()
    init_weights(model, seed)
    return model


def on_device(construct: Callable[[], Any], *, seed: int, device: str, dtype: torch.dtype) -> Any:
    """The module `construct()` builds, made without memory (on the meta device), then allocated on `device` in
    `dtype` and drawn there by :func:`init_weights`: billions of parameters in seconds on a GPU, with no float32 copy
    on the host. Its non-persistent buffers (rotary tables) are left unset: the result is for ``save_pretrained``."""
    with torch.device("meta"):
        model = construct()
    model = nn.Module.to(model, dtype).to_empty(device=device)
    init_weights(model, seed, device=device)
    return model.eval()


def build_vae(*, base_dim: int, z_dim: int, seed: int, **extra: Any) -> Any:
    """A Wan VAE with the Wan2.1 layout; `extra` goes to ``AutoencoderKLWan`` (the Wan2.2 VAE's residual blocks)."""
    from diffusers import AutoencoderKLWan

    reps = -(-z_dim // len(WAN21_LATENTS_MEAN))
    vae = AutoencoderKLWan(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        dropout=0.0,
        latents_mean=(WAN21_LATENTS_MEAN * reps)[:z_dim],
        latents_std=(WAN21_LATENTS_STD * reps)[:z_dim],
        **extra,
    )
    init_weights(vae, seed, out_gain={"decoder.conv_out": VAE_OUT_GAIN})
    return vae


def build_text_encoder(
    *,
    vocab_size: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    d_kv: int,
    d_ff: int,
    seed: int,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A UMT5 encoder (Wan's text encoder); with `device`, built in `dtype` on it by :func:`on_device`."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(  # type: ignore[call-arg]  # tie_word_embeddings is a PretrainedConfig keyword
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=num_layers,
        num_decoder_layers=num_layers,
        num_heads=num_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    config.architectures = ["UMT5EncoderModel"]
    if device is not None:
        return on_device(lambda: UMT5EncoderModel(config), seed=seed, device=device, dtype=dtype)
    model = UMT5EncoderModel(config)
    init_weights(model, seed)
    model.eval()
    return model


def build_scheduler(kind: str) -> Any:
    if kind == "unipc":
        from diffusers import UniPCMultistepScheduler

        # The configuration Wan-AI/Wan2.1-T2V-1.3B-Diffusers ships (everything else at its default).
        return UniPCMultistepScheduler(
            num_train_timesteps=1000,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=3.0,
            solver_order=2,
            solver_type="bh2",
            predict_x0=True,
            lower_order_final=True,
            final_sigmas_type="zero",
        )
    if kind == "flow":
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    raise ValueError(f"scheduler={kind!r} is not supported; use 'flow' or 'unipc'")


def cast(model: Any, dtype: torch.dtype) -> Any:
    # nn.Module.to directly: diffusers' ModelMixin.to warns about _keep_in_fp32_modules on every cast.
    return nn.Module.to(model, dtype)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def fresh_checkpoint_folder(out_dir: str | Path) -> Path:
    """`out_dir`, created empty: replaced if it is an empty folder or an earlier checkpoint (has
    ``model_index.json``), refused (FileExistsError) if it holds anything else."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir() or (any(out.iterdir()) and not (out / "model_index.json").is_file()):
            raise FileExistsError(f"out_dir={str(out)!r} exists and is not a checkpoint folder; refusing to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out
