"""Single-rank frames of every model family equal the matching diffusers pipeline's within 2 (uint8) for the same
checkpoint, prompt, image and seed: non-square sizes, both schedulers (UniPC and flow matching), several step counts,
with and without guidance, and with LoRA adapters (one case per family; both experts of T2V-A14B, the second expert
of I2V-A14B; diffusers loads them with ``load_lora_weights``, ``load_into_transformer_2`` for the second expert).
The speed plans are on (the default), so this also shows them exact for each family."""

from __future__ import annotations

import numpy as np
import pytest

from distvideo import VideoGenerator
from family_checkpoints import (
    DIFFUSERS_CLASS,
    diffusers_frames,
    family_checkpoint,
    lora_files,
    max_abs_diff,
    test_image,
)

pytestmark = pytest.mark.slow

PROMPT = "a red fox running through snow"
# (family, scheduler, image, request, LoRA adapters as (seed, strength, target)); the image as a file path, a PIL
# image or a uint8 array ("path", "pil", "array"), or None for text-to-video. Latent rows x columns:
# stride 16 (Wan2.1 VAE) or 32 (TI2V-5B's). The A14B requests run both experts (UniPC shift 12 at 4 steps:
# t = 1000, 973, 923 | 800; flow shift 12 at 3 steps: 1000, 960 | 857; shift 5 and boundary 0.9 likewise). A
# guidance scale of 1 runs its expert's one branch (diffusers runs both and adds nothing: the same frames within 2).
# Wan2.2 I2V-A14B with UniPC, an image and guidance_scale_2 is tests/test_families_bench.py's bench run.
CASES = [
    ("wan21_i2v", "unipc", "pil", dict(num_frames=5, height=32, width=48, num_inference_steps=3, guidance_scale=5.0),
     []),
    ("wan21_i2v", "flow", "path", dict(num_frames=9, height=48, width=32, num_inference_steps=2, guidance_scale=1.0),
     [(4, 0.8, "transformer")]),
    ("wan22_t2v_a14b", "unipc", None, dict(num_frames=9, height=48, width=80, num_inference_steps=4,
                                            guidance_scale=4.0, guidance_scale_2=3.0), []),
    ("wan22_t2v_a14b", "flow", None, dict(num_frames=5, height=32, width=48, num_inference_steps=3,
                                           guidance_scale=3.0, guidance_scale_2=1.0),
     [(1, 0.7, "transformer"), (2, 0.9, "transformer_2")]),
    ("wan22_i2v_a14b", "flow", "array", dict(num_frames=5, height=32, width=48, num_inference_steps=4,
                                          guidance_scale=5.0), [(3, 1.0, "transformer_2")]),
    ("wan22_ti2v_5b", "unipc", None, dict(num_frames=5, height=64, width=96, num_inference_steps=3,
                                           guidance_scale=5.0), []),
    ("wan22_ti2v_5b", "flow", "path", dict(num_frames=9, height=96, width=64, num_inference_steps=2,
                                         guidance_scale=4.0), []),
    ("wan22_ti2v_5b", "unipc", "array", dict(num_frames=5, height=32, width=64, num_inference_steps=4,
                                          guidance_scale=1.0), [(6, 0.8, "transformer")]),
]  # fmt: skip


def _case_id(case: tuple) -> str:
    family, scheduler, image, req, loras = case
    lora = "-lora" if loras else ""
    return f"{family}-{scheduler}-{f'i2v-{image}' if image else 't2v'}-{req['num_inference_steps']}steps{lora}"


def _image_as(form: str | None, path):
    """The test image in the form the case gives it to distvideo (diffusers always gets the PIL image)."""
    if form is None:
        return None
    from PIL import Image

    pil = Image.open(path).convert("RGB")
    return {"path": str(path), "pil": pil, "array": np.asarray(pil)}[form]


def _count_forwards(gen: VideoGenerator) -> dict[str, int]:
    """How often each transformer of the inline worker ran in the last request (hooks installed on first call)."""
    return gen.collective_rpc(_forward_counts)[0]


def _forward_counts(worker) -> dict[str, int]:
    pipeline = worker.pipeline
    counts = getattr(pipeline, "_test_forward_counts", None)
    if counts is None:
        counts = {}
        for name in ("transformer", "transformer_2"):
            module = getattr(pipeline, name, None)
            if module is not None:
                counts[name] = 0
                module.register_forward_pre_hook(lambda m, a, name=name: counts.__setitem__(name, counts[name] + 1))
        pipeline._test_forward_counts = counts
    return dict(counts)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_family_matches_diffusers(tmp_path_factory, case):
    family, scheduler, form, request, loras = case
    model = family_checkpoint(tmp_path_factory, family, scheduler)
    image = test_image(tmp_path_factory) if form else None
    adapters = lora_files(tmp_path_factory, model, loras)
    kwargs = dict(negative_prompt="blurry", image=_image_as(form, image), seed=5, save_video=False, **request)
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        before = _count_forwards(gen)
        res = gen.generate(PROMPT, **kwargs)
        after = _count_forwards(gen)
        if adapters:
            without = res.frames
            for i, (path, strength, target) in enumerate(adapters):
                gen.set_lora_adapter(f"a{i}", path, strength=strength, target=target)
            res = gen.generate(PROMPT, **kwargs)
            assert max_abs_diff(res.frames, without) > 10, "the adapters hardly change the video: a weak check"
    pipeline = "WanImageToVideoPipeline" if form else DIFFUSERS_CLASS[family]
    ref = diffusers_frames(model, pipeline, PROMPT, negative_prompt="blurry", image=image, seed=5, lora=adapters,
                           **request)  # fmt: skip
    assert res.frames.shape == (request["num_frames"], request["height"], request["width"], 3)
    assert res.frames.std() > 1.0, "flat frames would prove nothing"
    assert max_abs_diff(res.frames, ref) <= 2
    if "a14b" in family:  # the requests are chosen so that both experts run, the high-noise one first
        ran = {name: after[name] - before[name] for name in after}
        assert ran["transformer"] > 0 and ran["transformer_2"] > 0, ran
        if request.get("guidance_scale_2") == 1.0:  # 2 guided high-noise steps, 1 low-noise step in one branch
            assert ran == {"transformer": 4, "transformer_2": 1}, ran
