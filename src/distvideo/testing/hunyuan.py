"""Random-weight checkpoints in the shape of HunyuanVideo 1.5 (``HunyuanVideo15Pipeline`` like
``hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v``), for tests and benchmarks.

Every component is the class the published checkpoint names, built from its diffusers/transformers config at a tiny
width: the Qwen2.5-VL text model and its Qwen2 tokenizer (a byte-level BPE vocabulary built here, with a ChatML
template, so nothing is downloaded), the ByT5 glyph encoder (a T5 encoder) and its byte tokenizer, the
HunyuanVideo 1.5 transformer (dual-stream blocks, token refiner, 2 * latent + 1 input channels), the HunyuanVideo 1.5
VAE (spatial factor 16, temporal factor 4), the flow-matching Euler scheduler and the classifier-free guider.

    build_hunyuan_checkpoint(tmp_path / "hv15")
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from distvideo.testing.components import cast, fresh_checkpoint_folder, init_weights, write_json

__all__ = ["HUNYUAN_CHAT_TEMPLATE", "build_hunyuan_checkpoint"]

_SEEDS = {"transformer": 0, "vae": 1_000, "text_encoder": 2_000, "text_encoder_2": 2_500, "image_encoder": 3_000}

#: ChatML, as Qwen2.5's tokenizer ships it (text messages only): what `apply_chat_template` renders.
HUNYUAN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A few merges of common English pairs, so prompts are not all single bytes (ByteLevel's 'Ġ' is the space).
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "o n", "Ġ a", "r e", "e s", "a t", "o r", "e n", "i s"]


def build_qwen_tokenizer() -> Any:
    """A Qwen2Tokenizer over the 256 byte-level symbols, a few merges and ChatML's special tokens."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab: dict[str, int] = {}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    for merge in _MERGES:
        vocab.setdefault(merge.replace(" ", ""), len(vocab))
    for token in _SPECIAL:
        vocab[token] = len(vocab)
    merges = [(left, right) for left, right in (m.split(" ") for m in _MERGES)]
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)  # type: ignore[arg-type]  # tuples, as tokenizers' BPE takes
    tokenizer.chat_template = HUNYUAN_CHAT_TEMPLATE
    return tokenizer


def _qwen_text_encoder(vocab_size: int, hidden: int, seed: int) -> Any:
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    heads, head_dim = 2, hidden // 2
    config = Qwen2_5_VLTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,  # the pipeline reads hidden_states[-3]: the output of the first layer
        num_attention_heads=heads,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": _mrope(head_dim)},
        pad_token_id=vocab_size - 3,  # <|endoftext|>, as Qwen's tokenizer pads
        bos_token_id=None,
        eos_token_id=vocab_size - 1,  # <|im_end|>
    )
    model = Qwen2_5_VLTextModel(config)
    init_weights(model, seed)
    return model.eval()


def _mrope(head_dim: int) -> list[int]:
    """Qwen2.5-VL's (t, h, w) split of the rotary half-dimension, as [16, 24, 24] splits 64."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _byt5_encoder(hidden: int, seed: int) -> tuple[Any, Any]:
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer = ByT5Tokenizer()
    config = T5Config(  # type: ignore[call-arg]  # the last keywords are PretrainedConfig's
        vocab_size=len(tokenizer),
        d_model=hidden,
        d_kv=8,
        d_ff=2 * hidden,
        num_layers=1,
        num_heads=2,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    config.architectures = ["T5EncoderModel"]
    model = T5EncoderModel(config)
    init_weights(model, seed)
    return model.eval(), tokenizer


def _siglip(seed: int) -> tuple[Any, Any]:
    """The SigLIP stand-in: 54 px images in 2 px patches, so the image context has 27 x 27 = 729 tokens, as SigLIP's
    384 px images in 14 px patches give (the pipeline's `vision_num_semantic_tokens`)."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(
        hidden_size=SIGLIP_HIDDEN,
        intermediate_size=2 * SIGLIP_HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=54,
        patch_size=2,
    )
    model = SiglipVisionModel(config)
    init_weights(model, seed)
    return model.eval(), SiglipImageProcessor(size={"height": 54, "width": 54})


SIGLIP_HIDDEN = 16


def _transformer(
    *, latent: int, heads: int, head_dim: int, layers: int, text_dims: tuple[int, int], seed: int, **extra: Any
) -> Any:
    from diffusers import HunyuanVideo15Transformer3DModel

    third = 2 * (head_dim // 6)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=2 * latent + 1,  # noise, condition latents, condition mask
        out_channels=latent,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=layers,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=text_dims[0],
        text_embed_2_dim=text_dims[1],
        image_embed_dim=SIGLIP_HIDDEN,
        rope_axes_dim=(head_dim - 2 * third, third, third),
        **extra,
    )
    init_weights(model, seed)
    return model


def _vae(latent: int, base: int, seed: int) -> Any:
    from diffusers import AutoencoderKLHunyuanVideo15

    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=latent,
        block_out_channels=(base, base, 2 * base, 2 * base, 2 * base),
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
    )
    init_weights(vae, seed, out_gain={"decoder.conv_out.conv": 0.75})
    return vae


def build_hunyuan_checkpoint(
    out_dir: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    latent_channels: int = 8,
    text_dim: int = 32,
    vae_base_dim: int = 8,
    shift: float = 5.0,
    guidance_scale: float = 6.0,
    image_to_video: bool = False,
    target_size: int = 640,
    defaults: Mapping[str, Any] | None = None,
) -> Path:
    """Write a random-weight HunyuanVideo 1.5 checkpoint to `out_dir`; returns its path: text-to-video
    (``HunyuanVideo15Pipeline``), or with `image_to_video` ``HunyuanVideo15ImageToVideoPipeline`` (a SigLIP image
    encoder and its processor). `shift`: the scheduler's (5.0 for the 480p models); `guidance_scale`: the guider's;
    `target_size`: the transformer's (the image-to-video size bucket follows it; 640 for the 480p models);
    `defaults` goes to ``distvideo_defaults.json``."""
    import diffusers
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = fresh_checkpoint_folder(out_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = build_qwen_tokenizer()
        tokenizer.save_pretrained(out / "tokenizer")
        qwen = _qwen_text_encoder(len(tokenizer), text_dim, seed + _SEEDS["text_encoder"])
        cast(qwen, torch.float32).save_pretrained(out / "text_encoder", safe_serialization=True)
        byt5, byt5_tokenizer = _byt5_encoder(text_dim, seed + _SEEDS["text_encoder_2"])
        cast(byt5, torch.float32).save_pretrained(out / "text_encoder_2", safe_serialization=True)
        byt5_tokenizer.save_pretrained(out / "tokenizer_2")
        transformer = _transformer(
            latent=latent_channels,
            heads=num_attention_heads,
            head_dim=attention_head_dim,
            layers=num_layers,
            text_dims=(text_dim, text_dim),
            seed=seed + _SEEDS["transformer"],
            target_size=target_size,
            task_type="i2v" if image_to_video else "t2v",
        )
        transformer.save_pretrained(out / "transformer", safe_serialization=True)
        _vae(latent_channels, vae_base_dim, seed + _SEEDS["vae"]).save_pretrained(out / "vae", safe_serialization=True)
        if image_to_video:
            encoder, processor = _siglip(seed + _SEEDS["image_encoder"])
            encoder.save_pretrained(out / "image_encoder", safe_serialization=True)
            processor.save_pretrained(out / "feature_extractor")
    scheduler: Any = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.save_pretrained(out / "scheduler")  # ConfigMixin's, which the stubs do not show
    guider: Any = ClassifierFreeGuidance(guidance_scale=guidance_scale)
    guider.save_pretrained(out / "guider")
    index: dict[str, Any] = {
        "_class_name": "HunyuanVideo15ImageToVideoPipeline" if image_to_video else "HunyuanVideo15Pipeline",
        "_diffusers_version": diffusers.__version__,
        "guider": ["diffusers", "ClassifierFreeGuidance"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "tokenizer_2": ["transformers", "ByT5Tokenizer"],
        "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLHunyuanVideo15"],
    }
    if image_to_video:
        index["image_encoder"] = ["transformers", "SiglipVisionModel"]
        index["feature_extractor"] = ["transformers", "SiglipImageProcessor"]
    write_json(out / "model_index.json", index)
    if defaults is not None:
        write_json(out / "distvideo_defaults.json", dict(defaults))
    return out
