"""HunyuanVideo 1.5 text-to-video: the registry entry read from model_index.json (its defaults, the guider's scale, what
it refuses before any weight), and single-rank frames within 2 (uint8) of diffusers' HunyuanVideo15Pipeline on the
same random-weight checkpoint, prompt and seed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from distvideo import ConfigError, VideoGenerator
from distvideo.models.registry import probe_model
from distvideo.worker import pipeline_class

# a quoted glyph text, so the ByT5 branch runs (an unquoted prompt gives it zeros); a non-square size, guidance on
PROMPT = 'A neon sign reading "OPEN" flickers above a rainy street'
NEGATIVE = "blurry, low quality"
REQUEST = dict(num_frames=9, height=48, width=80, num_inference_steps=2, guidance_scale=4.5, seed=3)


def hunyuan_checkpoint(factory: pytest.TempPathFactory) -> Path:
    """The session's HunyuanVideo 1.5 test checkpoint (built once; the parallel tests share it)."""
    from distvideo.testing.hunyuan import build_hunyuan_checkpoint

    path = factory.getbasetemp() / "hunyuan15"
    if not (path / "model_index.json").is_file():
        build_hunyuan_checkpoint(path, seed=21)
    return path


def diffusers_hunyuan_frames(model: Path, prompt: str, *, guidance_scale: float, seed: int, **kwargs) -> np.ndarray:
    """HunyuanVideo15Pipeline's frames as uint8 (output_type='np', times 255, rounded), its guider at `guidance_scale`
    (diffusers takes the scale from the guider, not from the call)."""
    import torch
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(str(model))
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)
    generator = torch.Generator("cpu").manual_seed(seed)
    out = pipe(prompt=prompt, generator=generator, output_type="np", **kwargs).frames[0]
    return np.round(out * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hunyuan_checkpoint(tmp_path_factory)


def test_registry_entry_and_defaults(checkpoint: Path, tmp_path: Path) -> None:
    info = probe_model(checkpoint)
    assert info.family.name == "HunyuanVideo 1.5 T2V"
    assert pipeline_class(info.family).__name__ == "HunyuanVideo15T2VPipeline"
    assert (info.vae_scale_spatial, info.vae_scale_temporal, info.patch_size) == (16, 4, (1, 1, 1))
    assert info.latent_channels == 8  # the VAE's latent channels, not the transformer's 2 * 8 + 1 inputs
    assert info.defaults == {
        "num_frames": 121,
        "height": 480,
        "width": 848,
        "num_inference_steps": 50,
        "guidance_scale": 6.0,  # the guider's
        "fps": 24,
    }
    # the guider's scale is the default; a guider whose arithmetic is not plain CFG is refused, naming the setting
    guider = checkpoint / "guider" / "guider_config.json"
    config = json.loads(guider.read_text())
    view = tmp_path / "view"
    view.mkdir()
    for entry in checkpoint.iterdir():
        if entry.name != "guider":
            (view / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (view / "guider").mkdir()
    (view / "guider" / "guider_config.json").write_text(json.dumps({**config, "guidance_scale": 7.5}))
    assert probe_model(view).defaults["guidance_scale"] == 7.5
    # the default size is diffusers' 16:9 bucket of the transformer's target size (the 720p models': 960)
    (view / "transformer").unlink()
    (view / "transformer").mkdir()
    tr_config = json.loads((checkpoint / "transformer" / "config.json").read_text())
    (view / "transformer" / "config.json").write_text(json.dumps({**tr_config, "target_size": 960}))
    assert (probe_model(view).defaults["height"], probe_model(view).defaults["width"]) == (720, 1280)
    (view / "guider" / "guider_config.json").write_text(json.dumps({**config, "guidance_rescale": 0.7}))
    with pytest.raises(ConfigError, match=r"guidance_rescale=0\.7"):
        probe_model(view)


def test_request_checks_name_the_family(checkpoint: Path) -> None:
    from distvideo.request import GenerationRequest

    info = probe_model(checkpoint)
    with pytest.raises(ConfigError, match="height=40 must be a multiple of 16"):
        info.resolve_request(GenerationRequest(prompt="x", height=40, width=80))
    with pytest.raises(ConfigError, match="num_frames=8 must be of the form 4k\\+1"):
        info.resolve_request(GenerationRequest(prompt="x", num_frames=8))
    with pytest.raises(ConfigError, match=r"HunyuanVideo 1\.5 T2V"):
        info.resolve_request(GenerationRequest(prompt="x", image=np.zeros((16, 16, 3), np.uint8)))
    # the step cache serves its dual-stream blocks (tests/test_hunyuan_caching.py); mag still needs its ratios
    assert info.resolve_request(GenerationRequest(prompt="x", cache="first-block")).cache == "first-block"
    with pytest.raises(ConfigError, match="no MagCache ratios for 50 steps"):
        info.resolve_request(GenerationRequest(prompt="x", cache="mag"))


@pytest.mark.slow
def test_inline_frames_match_diffusers(checkpoint: Path) -> None:
    with VideoGenerator.from_pretrained(str(checkpoint)) as gen:
        result = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **REQUEST)
        again = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **REQUEST)
    assert result.frames is not None and result.frames.shape == (9, 48, 80, 3)
    assert np.array_equal(result.frames, again.frames)  # the same request twice: the same bytes
    assert result.frames.std() > 10  # not a flat video
    kwargs = {k: v for k, v in REQUEST.items() if k not in ("guidance_scale", "seed")}
    reference = diffusers_hunyuan_frames(
        checkpoint, PROMPT, negative_prompt=NEGATIVE, guidance_scale=REQUEST["guidance_scale"], seed=3, **kwargs
    )
    assert int(np.abs(reference.astype(np.int16) - result.frames.astype(np.int16)).max()) <= 2


@pytest.mark.slow
def test_lora_in_diffusers_naming_matches_diffusers(checkpoint: Path, tmp_path: Path) -> None:
    """A diffusers/PEFT LoRA file (keys ``transformer.transformer_blocks.N.attn.to_q.lora_A.weight``) on the joint
    attention and the feed-forward of both streams: the same frames (within 2) as diffusers' transformer with the
    same file (``load_lora_adapter``; HunyuanVideo15Pipeline has no pipeline-level LoRA loader)."""
    from distvideo.testing.lora_files import build_random_lora

    pattern = r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_k_proj|to_add_out)|ff_context\.net\.2|ff\.net\.2)"
    path = build_random_lora(checkpoint, tmp_path / "hv.safetensors", layout="diffusers", seed=4, pattern=pattern)
    request = {**REQUEST, "seed": 9}
    with VideoGenerator.from_pretrained(str(checkpoint)) as gen:
        base = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **request).frames
        gen.set_lora_adapter("style", str(path), strength=0.8)
        adapted = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **request).frames
    assert base is not None and adapted is not None
    assert int(np.abs(base.astype(np.int16) - adapted.astype(np.int16)).max()) > 10, "the adapter must matter"

    import torch
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(str(checkpoint))
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=request["guidance_scale"])
    pipe.transformer.load_lora_adapter(str(path), adapter_name="style", prefix="transformer")
    pipe.transformer.set_adapters(["style"], [0.8])
    kwargs = {k: v for k, v in request.items() if k not in ("guidance_scale", "seed")}
    out = pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        generator=torch.Generator("cpu").manual_seed(9),
        output_type="np",
        **kwargs,
    ).frames[0]
    reference = np.round(out * 255).astype(np.uint8)
    assert int(np.abs(reference.astype(np.int16) - adapted.astype(np.int16)).max()) <= 2


def test_flop_count_matches_torchs_counter(checkpoint: Path) -> None:
    """The bench's analytic FLOPs of one transformer forward: its matmul terms equal torch's FlopCounterMode on a
    real forward to 0.1% (the rest are the per-sample terms it leaves out); the attention terms, which the counter
    does not see on CPU, are 2 * 2 * L^2 * D per layer by construction."""
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    from distvideo.families.hunyuan15.flops import HUNYUAN15_TOKENS, hunyuan15_transformer_flops_breakdown

    model = HunyuanVideo15Transformer3DModel.from_pretrained(str(checkpoint / "transformer")).eval()
    config = json.loads((checkpoint / "transformer" / "config.json").read_text())
    latents = torch.randn(1, 2 * 8 + 1, 3, 3, 5)
    text = HUNYUAN15_TOKENS["mllm"]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(
            hidden_states=latents,
            timestep=torch.tensor([999.0]),
            encoder_hidden_states=torch.randn(1, text, 32),
            encoder_attention_mask=torch.ones(1, text),
            encoder_hidden_states_2=torch.randn(1, HUNYUAN15_TOKENS["byt5"], 32),
            encoder_attention_mask_2=torch.zeros(1, HUNYUAN15_TOKENS["byt5"]),
            image_embeds=torch.zeros(1, HUNYUAN15_TOKENS["image"], 16),
            return_dict=False,
        )
    parts = hunyuan15_transformer_flops_breakdown(config, latents.shape)
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    refiner_attention = config["num_refiner_layers"] * 2 * 2 * text * text * dim
    matmuls = sum(parts.values()) - parts["attention"] - refiner_attention
    assert abs(matmuls / counter.get_total_flops() - 1) < 1e-3
    joint = 3 * 3 * 5 + sum(HUNYUAN15_TOKENS.values())
    assert parts["attention"] == config["num_layers"] * 2 * 2 * joint * joint * dim
