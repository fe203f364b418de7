"""The embedded tiny Wan model: shipped files, deterministic regeneration, and a diffusers run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from distvideo.models.embedded import TINY_MODEL_DIR, tiny_model_path
from distvideo.testing.checkpoints import EMBEDDED_DEFAULTS, build_embedded_model, build_tiny_wan

COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")
# Written by the libraries into configs; they change with the installed version, not with the model.
VERSION_KEYS = ("_diffusers_version", "transformers_version")


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def _config_without_versions(path: Path) -> dict:
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if k not in VERSION_KEYS}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_embedded_model_is_small_and_complete() -> None:
    root = tiny_model_path()
    assert root == TINY_MODEL_DIR
    files = _files(root)
    total = sum(p.stat().st_size for p in files.values())
    assert total < 1_000_000, f"embedded model is {total} bytes"
    for component in COMPONENTS:
        assert (root / component).is_dir(), component

    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert {k: v for k, v in index.items() if not k.startswith("_")} == {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    assert json.loads((root / "distvideo_defaults.json").read_text()) == EMBEDDED_DEFAULTS
    assert "transformer/diffusion_pytorch_model.safetensors" in files
    assert "vae/diffusion_pytorch_model.safetensors" in files
    assert "text_encoder/model.safetensors" in files
    assert "tokenizer/tokenizer.json" in files


def test_regenerating_gives_the_shipped_files(tmp_path: Path) -> None:
    shipped = _files(tiny_model_path())
    rebuilt = _files(build_embedded_model(tmp_path / "tiny-wan"))
    assert sorted(rebuilt) == sorted(shipped)
    for name, path in shipped.items():
        if name.endswith(".json") and not name.startswith("tokenizer/"):
            assert _config_without_versions(rebuilt[name]) == _config_without_versions(path), name
        else:  # weights and the tokenizer: exact bytes
            assert _sha256(rebuilt[name]) == _sha256(path), name


def test_tokenizer_matches_what_wan_pipeline_expects() -> None:
    from transformers import T5TokenizerFast, UMT5Config

    root = tiny_model_path()
    tok = T5TokenizerFast.from_pretrained(root / "tokenizer")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert len(tok) == UMT5Config.from_pretrained(root / "text_encoder").vocab_size
    enc = tok(
        ["A fluffy cat jumps over a snowy field.", ""],
        padding="max_length",
        max_length=512,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids, mask = enc.input_ids, enc.attention_mask
    assert ids.shape == mask.shape == (2, 512)
    n = int(mask[0].sum())
    assert 3 < n < 40 and ids[0, n - 1] == 1 and (ids[0, n:] == 0).all() and (ids[0, : n - 1] != 2).all()
    assert mask[1].sum() == 1 and ids[1, 0] == 1


def test_embedded_model_runs_in_diffusers_deterministically() -> None:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_model_path())
    pipe.set_progress_bar_config(disable=True)

    def run() -> np.ndarray:
        return pipe(
            "A fox runs across a snowy field",
            num_frames=9,
            height=64,
            width=64,
            num_inference_steps=2,
            guidance_scale=5.0,
            output_type="np",
            generator=torch.Generator("cpu").manual_seed(0),
        ).frames[0]

    first = run()
    assert first.shape == (9, 64, 64, 3)
    assert np.isfinite(first).all()
    assert first.std() > 0.05
    assert first.std(axis=(1, 2, 3)).min() > 0  # no constant frame
    np.testing.assert_array_equal(run(), first)


def test_build_rejects_bad_arguments_and_keeps_global_rng(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scheduler"):
        build_tiny_wan(tmp_path / "a", scheduler="ddim")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention_head_dim"):
        build_tiny_wan(tmp_path / "b", attention_head_dim=4)

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_wan(tmp_path / "c", num_layers=1, vae_base_dim=4, scheduler="unipc")
    assert torch.equal(torch.rand(3), expected)
    index = json.loads((tmp_path / "c" / "model_index.json").read_text())
    assert index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    assert not (tmp_path / "c" / "distvideo_defaults.json").exists()
