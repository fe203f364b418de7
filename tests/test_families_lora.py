"""LoRA on every model family: frames equal diffusers' ``load_lora_weights`` (``load_into_transformer_2`` for the
second expert of Wan2.2 A14B), unmerged adapters apply on the fly over bit-identical base weights, clearing restores
the base of both experts, and an adapter for a transformer the model does not have is refused."""

from __future__ import annotations

import numpy as np
import pytest

from distvideo import VideoGenerator
from distvideo.config import LoraSpec
from distvideo.lora import LoraError
from distvideo.lora.rank import describe, transformer_digest
from distvideo.testing.lora_files import build_random_lora
from family_checkpoints import diffusers_frames, family_checkpoint, max_abs_diff, test_image

PROMPT = "a red fox running through snow"
# A14B T2V with UniPC (shift 12) at 4 steps: three high-noise steps and one low-noise step
REQUESTS = {
    "wan22_t2v_a14b": dict(num_frames=5, height=32, width=48, num_inference_steps=4, guidance_scale=4.0, seed=3),
    "wan21_i2v": dict(num_frames=5, height=32, width=48, num_inference_steps=2, seed=3),
    "wan22_ti2v_5b": dict(num_frames=5, height=32, width=64, num_inference_steps=2, seed=3),
}


def _frames(gen: VideoGenerator, family: str, image) -> np.ndarray:
    return gen.generate(PROMPT, image=image, save_video=False, **REQUESTS[family]).frames


@pytest.mark.slow
def test_a14b_adapters_on_both_experts_match_diffusers(tmp_path_factory, tmp_path):
    family = "wan22_t2v_a14b"
    model = family_checkpoint(tmp_path_factory, family)
    high = build_random_lora(model, tmp_path / "high.safetensors", layout="diffusers", seed=1)
    low = build_random_lora(model, tmp_path / "low.safetensors", layout="wan", seed=2, alpha=2.0)
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        base_frames, base_digest = _frames(gen, family, None), gen.collective_rpc(transformer_digest)[0]
        gen.set_lora_adapter("low", low, strength=0.9, target="transformer_2")
        low_only = _frames(gen, family, None)
        gen.set_lora_adapter("high", high, strength=0.7)
        ours = _frames(gen, family, None)
        state = gen.collective_rpc(describe)[0]
        assert state["active"] == [["high", 0.7]] and state["transformer_2"]["active"] == [["low", 0.9]]
        gen.unmerge_lora_weights()
        assert gen.collective_rpc(transformer_digest)[0] == base_digest, "unmerged: both experts' base weights"
        assert max_abs_diff(_frames(gen, family, None), ours) <= 2
        gen.merge_lora_weights()
        gen.clear_lora_adapters()
        assert gen.collective_rpc(transformer_digest)[0] == base_digest, "cleared: both experts bit for bit"
    ref = diffusers_frames(
        model, "WanPipeline", PROMPT, lora=[(high, 0.7, False), (low, 0.9, True)], **REQUESTS[family]
    )
    assert max_abs_diff(low_only, base_frames) > 5, "the second expert's adapter must change the video"
    assert max_abs_diff(ref, base_frames) > 20, "the adapters hardly change the frames: the check would be weak"
    assert max_abs_diff(ours, ref) <= 2


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan21_i2v", "wan22_ti2v_5b"])
def test_family_adapter_matches_diffusers(tmp_path_factory, tmp_path, family):
    """Image-to-video on both (TI2V-5B through diffusers' WanImageToVideoPipeline); Wan2.1 I2V's adapter also changes
    the image cross-attention (add_k_proj, add_v_proj)."""
    model = family_checkpoint(tmp_path_factory, family)
    image = test_image(tmp_path_factory)
    lora = build_random_lora(model, tmp_path / "a.safetensors", layout="wan", seed=4, alpha=2.0)
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        base = _frames(gen, family, image)
        gen.set_lora_adapter("a", lora, strength=0.8)
        ours = _frames(gen, family, image)
    ref = diffusers_frames(
        model, "WanImageToVideoPipeline", PROMPT, image=image, lora=[(lora, 0.8, False)], **REQUESTS[family]
    )
    assert max_abs_diff(ref, base) > 20, "the adapter hardly changes the frames: the check would be weak"
    assert max_abs_diff(ours, ref) <= 2


def test_second_expert_target_on_a_one_expert_model_is_refused(tmp_path_factory, tmp_path):
    model = family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")
    lora = build_random_lora(model, tmp_path / "a.safetensors", seed=5)
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        before = gen.collective_rpc(transformer_digest)[0]
        with pytest.raises(LoraError, match=r"LoRA target 'transformer_2': this model has no transformer_2"):
            gen.set_lora_adapter("a", lora, target="transformer_2")
        with pytest.raises(LoraError, match=r"target must be one of transformer, transformer_2"):
            gen.set_lora_adapter("a", lora, target="vae")
        assert gen.collective_rpc(transformer_digest)[0] == before


def test_lora_spec_target():
    assert LoraSpec.parse("transformer_2=low.safetensors:0.5") == LoraSpec("low.safetensors", 0.5, "transformer_2")
    assert LoraSpec.parse("c:/x.safetensors") == LoraSpec("c:/x.safetensors", 1.0, "transformer")
