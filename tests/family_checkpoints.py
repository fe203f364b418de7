"""Random-weight checkpoints of every model family, built once per test session, and diffusers' reference frames."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

#: family -> seed of its test checkpoint (distinct, so no two families share weights)
SEEDS = {"wan21_i2v": 11, "wan22_t2v_a14b": 12, "wan22_i2v_a14b": 13, "wan22_ti2v_5b": 14}
#: the diffusers pipeline that is each family's reference (TI2V-5B: WanPipeline without an image)
DIFFUSERS_CLASS = {
    "wan21_i2v": "WanImageToVideoPipeline",
    "wan22_t2v_a14b": "WanPipeline",
    "wan22_i2v_a14b": "WanImageToVideoPipeline",
    "wan22_ti2v_5b": "WanPipeline",
}
_BUILT: dict[tuple[str, str], Path] = {}
#: `python -c BUILD_FAMILY folder family`: the session's checkpoint of a family (UniPC), the same bytes, built in a
#: process of its own (a background job's, tests/background.py)
BUILD_FAMILY = (
    "import sys; from distvideo.testing.families import build_family_checkpoint as b; "
    f"b(sys.argv[2], sys.argv[1], scheduler='unipc', seed={SEEDS}[sys.argv[2]])"
)


def family_checkpoint(factory: pytest.TempPathFactory, family: str, scheduler: str = "unipc") -> Path:
    """The session's checkpoint of `family` with the UniPC scheduler, or a view of it with the flow-matching one."""
    from distvideo.testing.families import build_family_checkpoint, with_scheduler

    key = (family, scheduler)
    if key not in _BUILT:
        base = factory.getbasetemp() / "families"
        base.mkdir(exist_ok=True)
        if scheduler == "unipc":
            _BUILT[key] = build_family_checkpoint(family, base / family, scheduler="unipc", seed=SEEDS[family])
        else:
            _BUILT[key] = with_scheduler(family_checkpoint(factory, family), base / f"{family}-{scheduler}", scheduler)
    return _BUILT[key]


def test_image(factory: pytest.TempPathFactory, seed: int = 0, size: tuple[int, int] = (40, 28)) -> Path:
    """A smooth random PNG (width x height `size`), once per session and seed."""
    from distvideo.testing.families import write_test_image

    path = factory.getbasetemp() / f"image-{seed}-{size[0]}x{size[1]}.png"
    if not path.exists():
        write_test_image(path, width=size[0], height=size[1], seed=seed)
    return path


test_image.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def lora_files(factory: pytest.TempPathFactory, model: Path, loras: list[tuple]) -> list[tuple[Path, float, str]]:
    """Random LoRA files for `model`, once per session: [(seed, strength, target)] -> [(path, strength, target)].
    Odd seeds are written in diffusers' key layout, even ones in the original Wan layout with an alpha."""
    from distvideo.testing.lora_files import build_random_lora

    folder = factory.getbasetemp() / "family-loras"
    folder.mkdir(exist_ok=True)
    out = []
    for seed, strength, target in loras:
        path = folder / f"{model.name}-{seed}.safetensors"
        if not path.exists():
            layout, alpha = ("diffusers", None) if seed % 2 else ("wan", 2.0)
            build_random_lora(model, path, layout=layout, seed=seed, alpha=alpha)
        out.append((path, strength, target))
    return out


def diffusers_frames(model: Path, pipeline: str, prompt: str, *, image: Any = None, **kwargs: Any) -> np.ndarray:
    """The diffusers pipeline's frames as uint8 (output_type='np', times 255, rounded); `image` a path or None."""
    import diffusers
    import torch
    from PIL import Image

    seed = kwargs.pop("seed", 0)
    lora = kwargs.pop("lora", None)  # [(path, strength, target)]
    cls = getattr(diffusers, pipeline)
    pipe = cls.from_pretrained(str(model))
    pipe.set_progress_bar_config(disable=True)
    if lora:
        for i, (path, _, second) in enumerate(lora):
            into_2 = second == "transformer_2"
            pipe.load_lora_weights(str(path), adapter_name=f"a{i}", load_into_transformer_2=into_2)
        pipe.set_adapters([f"a{i}" for i in range(len(lora))], [s for _, s, _ in lora])
    if image is not None:
        kwargs["image"] = Image.open(image).convert("RGB")
    generator = torch.Generator("cpu").manual_seed(seed)
    out = pipe(prompt=prompt, generator=generator, output_type="np", **kwargs).frames[0]
    return np.round(out * 255).astype(np.uint8)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
