"""LoRA on the families beyond what the parity tests check (tests/test_families_parity.py compares frames with
adapters against diffusers' ``load_lora_weights`` for every family, both experts included): each A14B expert has its
own adapters, unmerged adapters apply on the fly over the bit-identical base weights of both experts, clearing
restores both, and an adapter for a transformer the model does not have is refused."""

from __future__ import annotations

import pytest

from distvideo import VideoGenerator
from distvideo.config import LoraSpec
from distvideo.lora import LoraError
from distvideo.lora.rank import describe, transformer_digest
from family_checkpoints import family_checkpoint, lora_files, max_abs_diff

PROMPT = "a red fox running through snow"
# UniPC with shift 12 at 2 steps: t = 999 (high-noise expert), 923 (low-noise, below 0.95 * 1000)
REQUEST = dict(num_frames=5, height=32, width=32, num_inference_steps=2, boundary_ratio=0.95, guidance_scale=4.0,
               seed=3, save_video=False)  # fmt: skip


def test_each_expert_has_its_own_adapters(tmp_path_factory):
    model = family_checkpoint(tmp_path_factory, "wan22_t2v_a14b")
    (high, _, _), (low, _, _) = lora_files(tmp_path_factory, model, [(1, 0.7, ""), (2, 0.9, "")])
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        base_frames, base_digest = gen.generate(PROMPT, **REQUEST).frames, gen.collective_rpc(transformer_digest)[0]
        gen.set_lora_adapter("low", low, strength=0.9, target="transformer_2")
        low_only = gen.generate(PROMPT, **REQUEST).frames
        assert max_abs_diff(low_only, base_frames) > 5, "the low-noise expert's adapter changes its last step"
        gen.set_lora_adapter("high", high, strength=0.7)  # replaces the stack of `transformer` only
        both = gen.generate(PROMPT, **REQUEST).frames
        state = gen.collective_rpc(describe)[0]
        assert state["active"] == [["high", 0.7]] and state["transformer_2"]["active"] == [["low", 0.9]]
        gen.unmerge_lora_weights()
        assert gen.collective_rpc(transformer_digest)[0] == base_digest, "unmerged: both experts' base weights"
        assert gen.collective_rpc(describe)[0]["transformer_2"]["merged"] is False
        assert max_abs_diff(gen.generate(PROMPT, **REQUEST).frames, both) <= 2
        gen.merge_lora_weights()
        gen.set_lora_adapter("low", strength=0.0, target="transformer_2")  # switch (cached), strength 0
        gen.clear_lora_adapters()
        assert gen.collective_rpc(transformer_digest)[0] == base_digest, "cleared: both experts bit for bit"
        state = gen.collective_rpc(describe)[0]
        assert state["active"] == [] and state["transformer_2"] == {
            "active": [], "merged": True, "separate": False, "cached": ["low"], "touched_layers": 0
        }  # fmt: skip


def test_second_expert_target_on_a_one_expert_model_is_refused(tmp_path_factory):
    model = family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")
    [(lora, _, _)] = lora_files(tmp_path_factory, model, [(5, 1.0, "")])
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        before = gen.collective_rpc(transformer_digest)[0]
        with pytest.raises(LoraError, match=r"LoRA target 'transformer_2': this model has no transformer_2"):
            gen.set_lora_adapter("a", lora, target="transformer_2")
        with pytest.raises(LoraError, match=r"target must be one of transformer, transformer_2"):
            gen.set_lora_adapter("a", lora, target="vae")
        assert gen.collective_rpc(transformer_digest)[0] == before
        assert "transformer_2" not in gen.collective_rpc(describe)[0]


def test_lora_spec_target():
    assert LoraSpec.parse("transformer_2=low.safetensors:0.5") == LoraSpec("low.safetensors", 0.5, "transformer_2")
    assert LoraSpec.parse("c:/x.safetensors") == LoraSpec("c:/x.safetensors", 1.0, "transformer")
