"""LoRA file formats beyond the low-rank pairs of tests/test_lora.py (docs/lora.md, "File formats"): full weight and
bias deltas (``.diff``, ``.diff_b``, ``lora_B.bias``) added times the strength, merged and on the fly; PEFT's
``base_model.model.`` prefix; the Wan2.1 I2V image-embedding projection (``img_emb.proj.{1,3}``); fp16 and bf16
files; and the CLI's exit 2 naming the file and the key or layer for a corrupt or mismatched file.

Every check reads the weights after the change and compares them with the delta the file holds, computed here from
the base weights: "something changed" would pass with a wrong strength or a wrong layer.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from distvideo import VideoGenerator
from distvideo.cli.main import main
from distvideo.lora import read_lora_file
from distvideo.lora.layers import LoraState
from distvideo.testing.lora_files import random_lora_layers, save_lora_file

SMALL_FLAGS = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "1", "--no-progress"]


def randn(*shape: int, seed: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator("cpu").manual_seed(seed)) * scale


@pytest.fixture(scope="module")
def gen(tiny_model):
    with VideoGenerator.from_pretrained(tiny_model, executor="inline") as g:
        yield g


@pytest.fixture(scope="module")
def base(gen) -> dict[str, torch.Tensor]:
    """The tiny model's transformer weights with no adapter."""
    gen.clear_lora_adapters()
    return {k: v.detach().clone() for k, v in transformer_of(gen).state_dict().items()}


@pytest.fixture(autouse=True)
def _no_adapter_left(request):
    yield
    if "gen" in request.fixturenames:
        request.getfixturevalue("gen").clear_lora_adapters()


def transformer_of(g) -> torch.nn.Module:
    return g.executor.worker.pipeline.transformer


def assert_weights(model: torch.nn.Module, base: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """`expected` parameters (name -> value) within float32 rounding, every other one bit-identical to `base`."""
    state = model.state_dict()
    for name, value in state.items():
        if name in expected:
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert torch.equal(value, base[name]), f"{name} changed, but the file has no delta for it"


# --- full weight and bias deltas -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deltas() -> dict[str, torch.Tensor]:
    """Wan-layout deltas on three kinds of layer: a full weight delta with its bias delta, a bias delta alone, and a
    low-rank pair with a bias delta (lightx2v's distillation files look like this)."""
    return {
        "diffusion_model.blocks.0.ffn.0.diff": randn(64, 32, seed=1),
        "diffusion_model.blocks.0.ffn.0.diff_b": randn(64, seed=2),
        "diffusion_model.blocks.1.cross_attn.o.diff_b": randn(32, seed=3),
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": randn(4, 32, seed=4, scale=0.3),
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": randn(32, 4, seed=5, scale=0.3),
        "diffusion_model.blocks.0.self_attn.q.diff_b": randn(32, seed=6),
    }


def expected_with_deltas(base: dict[str, torch.Tensor], d: dict[str, torch.Tensor], s: float) -> dict:
    p = "diffusion_model.blocks."
    q_delta = d[f"{p}0.self_attn.q.lora_up.weight"] @ d[f"{p}0.self_attn.q.lora_down.weight"]
    return {
        "blocks.0.ffn.net.0.proj.weight": base["blocks.0.ffn.net.0.proj.weight"] + s * d[f"{p}0.ffn.0.diff"],
        "blocks.0.ffn.net.0.proj.bias": base["blocks.0.ffn.net.0.proj.bias"] + s * d[f"{p}0.ffn.0.diff_b"],
        "blocks.1.attn2.to_out.0.bias": base["blocks.1.attn2.to_out.0.bias"] + s * d[f"{p}1.cross_attn.o.diff_b"],
        "blocks.0.attn1.to_q.weight": base["blocks.0.attn1.to_q.weight"] + s * q_delta,
        "blocks.0.attn1.to_q.bias": base["blocks.0.attn1.to_q.bias"] + s * d[f"{p}0.self_attn.q.diff_b"],
    }


def test_diff_and_diff_b_are_added_times_the_strength(gen, base, deltas, tmp_path):
    """Merged: each weight and bias is base + 0.5 x its delta (not the whole delta, not untouched); unmerged: the
    base bits are back and each layer's output is that of the merged weights."""
    path = tmp_path / "deltas.safetensors"
    save_file(deltas, str(path))
    gen.set_lora_adapter("deltas", path, strength=0.5)
    expected = expected_with_deltas(base, deltas, 0.5)
    assert_weights(transformer_of(gen), base, expected)

    gen.unmerge_lora_weights()
    assert_weights(transformer_of(gen), base, {})
    x = randn(3, 32, seed=7, scale=1.0)
    for layer in ("blocks.0.ffn.net.0.proj", "blocks.1.attn2.to_out.0", "blocks.0.attn1.to_q"):
        module = transformer_of(gen).get_submodule(layer)
        with torch.no_grad():
            on_the_fly = module(x)
        merged = F.linear(x, expected.get(f"{layer}.weight", base[f"{layer}.weight"]), expected[f"{layer}.bias"])
        torch.testing.assert_close(on_the_fly, merged, rtol=0, atol=1e-5, msg=lambda m, n=layer: f"{n}: {m}")


def test_peft_base_model_prefix_and_lora_b_bias(gen, base, tiny_model, tmp_path):
    """A PEFT-saved file (``base_model.model.blocks...lora_A.weight``, ``lora_B.bias`` with lora_bias=True) changes
    the same layers by the same amounts as diffusers' ``transformer.`` naming."""
    layers = random_lora_layers(tiny_model, rank=4, seed=11, pattern=r"blocks\.1\.attn1\..*")
    bias = randn(32, seed=12)
    tensors = {}
    for name, (down, up) in layers.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = down.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = up.contiguous()
    tensors["base_model.model.blocks.1.attn1.to_v.lora_B.bias"] = bias
    path = tmp_path / "adapter_model.safetensors"  # the name PEFT's save_pretrained gives it
    save_file(tensors, str(path))
    gen.set_lora_adapter("peft", path, strength=0.8)
    expected = {f"{name}.weight": base[f"{name}.weight"] + 0.8 * (up @ down) for name, (down, up) in layers.items()}
    expected["blocks.1.attn1.to_v.bias"] = base["blocks.1.attn1.to_v.bias"] + 0.8 * bias
    assert len(expected) == 5, sorted(expected)  # 4 attention projections and one bias
    assert_weights(transformer_of(gen), base, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_files_load_and_apply(gen, base, tiny_model, tmp_path, dtype):
    """fp16 and bf16 files (as most published adapters are) are read in their own dtype and applied in float32:
    the change is strength x alpha / rank x up @ down of the stored (rounded) values, plus the bias delta."""
    layers = random_lora_layers(tiny_model, rank=4, seed=13, pattern=r"blocks\.0\.(attn2|ffn)\..*")
    path = save_lora_file(tmp_path / "half.safetensors", layers, layout="wan", alpha=2.0, dtype=dtype)
    bias = randn(32, seed=14).to(dtype)
    with_bias = load_file(str(path))
    with_bias["diffusion_model.blocks.0.ffn.2.diff_b"] = bias
    save_file(with_bias, str(path))
    with safe_open(str(path), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if not k.endswith(".alpha")} == {dtype}
    gen.set_lora_adapter("half", path, strength=0.7)
    expected = {
        f"{name}.weight": base[f"{name}.weight"] + (0.7 * 2.0 / 4) * (up.to(dtype).float() @ down.to(dtype).float())
        for name, (down, up) in layers.items()
    }
    expected["blocks.0.ffn.net.2.bias"] = base["blocks.0.ffn.net.2.bias"] + 0.7 * bias.float()
    assert all(transformer_of(gen).state_dict()[name].dtype == base[name].dtype for name in expected)
    assert_weights(transformer_of(gen), base, expected)


# --- Wan2.1 I2V's image-embedding projection -------------------------------------------------------------------------
def test_img_emb_proj_maps_to_the_image_embedder(tmp_path):
    """``img_emb.proj.1`` / ``.3`` (Wan's Sequential: LayerNorm, Linear, GELU, Linear, LayerNorm) are diffusers'
    ``condition_embedder.image_embedder.ff.net.0.proj`` / ``ff.net.2`` of an I2V transformer, as diffusers' own
    conversion names them; applying the file changes exactly those layers by their deltas."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    model = WanTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
        ffn_dim=32, num_layers=1, image_dim=24, added_kv_proj_dim=16,
    )  # fmt: skip
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pairs = {  # Wan name -> (down, up, the diffusers layer); image_dim 24 -> 24 -> inner dim 16
        "img_emb.proj.1": (randn(4, 24, seed=21), randn(24, 4, seed=22), "condition_embedder.image_embedder.ff.net.0.proj"),
        "img_emb.proj.3": (randn(4, 24, seed=23), randn(16, 4, seed=24), "condition_embedder.image_embedder.ff.net.2"),
        "blocks.0.cross_attn.k_img": (randn(4, 16, seed=25), randn(16, 4, seed=26), "blocks.0.attn2.add_k_proj"),
        "blocks.0.cross_attn.v_img": (randn(4, 16, seed=27), randn(16, 4, seed=28), "blocks.0.attn2.add_v_proj"),
    }  # fmt: skip
    tensors = {}
    for wan, (down, up, _) in pairs.items():
        tensors[f"diffusion_model.{wan}.lora_down.weight"] = down
        tensors[f"diffusion_model.{wan}.lora_up.weight"] = up
    path = tmp_path / "i2v.safetensors"
    save_file(tensors, str(path))

    theirs = WanImageToVideoPipeline.lora_state_dict(str(path))
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    their_layers = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in theirs}
    assert set(read_lora_file(path).layers) == their_layers == {layer for *_, layer in pairs.values()}

    state = LoraState(model)
    state.prepare("i2v", lambda: read_lora_file(path), strength=0.6, accumulate=False)
    state.commit()
    expected = {f"{layer}.weight": base[f"{layer}.weight"] + 0.6 * (up @ down) for down, up, layer in pairs.values()}
    assert_weights(model, base, expected)


# --- the CLI: exit 2, naming the file and what does not fit --------------------------------------------------------
def _truncated(path, tiny_model):
    good = save_lora_file(path, random_lora_layers(tiny_model, rank=4, seed=31), layout="diffusers").read_bytes()
    path.write_bytes(good[: len(good) // 2])  # an interrupted download
    return [r"not a valid \.safetensors file", "corrupt"]


def _wrong_shapes(path, tiny_model):
    layers = random_lora_layers(tiny_model, rank=4, seed=32, pattern=r"blocks\.0\.attn1\..*")
    layers["blocks.0.attn1.to_k"] = (torch.zeros(4, 48), layers["blocks.0.attn1.to_k"][1])  # for a wider model
    save_lora_file(path, layers, layout="wan")
    return [r"layer blocks\.0\.attn1\.to_k is Linear\(in_features=32", r"\(4, 48\), expected \(rank, 32\)"]


def _unknown_keys(path, tiny_model):
    layers = random_lora_layers(tiny_model, rank=4, seed=33, pattern=r"blocks\.0\.attn1\..*")
    save_lora_file(path, layers, layout="diffusers")
    tensors = load_file(str(path))
    tensors["transformer.blocks.0.attn1.to_q.hada_w1_a"] = torch.zeros(4, 32)  # a LoHa tensor
    save_file(tensors, str(path))
    return [r"1 key\(s\) are not LoRA tensors distvideo knows: transformer\.blocks\.0\.attn1\.to_q\.hada_w1_a"]


@pytest.mark.parametrize("make", [_truncated, _wrong_shapes, _unknown_keys], ids=["corrupt", "shapes", "unknown-keys"])
def test_cli_exits_2_naming_the_file_and_the_problem(tiny_model, tmp_path, capsys, make):
    lora = tmp_path / "adapter.safetensors"
    patterns = make(lora, tiny_model)
    out = tmp_path / "out" / "v.mp4"
    argv = ["generate", "--prompt", "a fox", "--executor", "inline", "--output", str(out), *SMALL_FLAGS]
    assert main([*argv, "--lora", f"{lora}:0.5"]) == 2
    err = capsys.readouterr().err
    assert f"LoRA file {str(lora.resolve())!r}" in err, err
    for pattern in patterns:
        assert re.search(pattern, err), (pattern, err)
    assert not out.parent.exists() or list(out.parent.iterdir()) == [], "nothing is written"
