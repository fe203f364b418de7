#!/usr/bin/env python
"""Print, as a markdown table, the max abs difference between distvideo's and diffusers' frames for every case of
tests/test_families_parity.py (the same checkpoints, seeds and requests; the test asserts <= 2).

    python scripts/family_parity.py [--folder DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DISTVIDEO_NO_PROGRESS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]


class _Factory:
    """The one method of pytest's TempPathFactory the test helpers use."""

    def __init__(self, base: Path):
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/distvideo-family-parity", help="where the checkpoints are built")
    args = parser.parse_args()
    import family_checkpoints as fc
    from distvideo import VideoGenerator
    from test_families_parity import CASES, PROMPT, _image_as

    factory = _Factory(Path(args.folder))
    factory.base.mkdir(parents=True, exist_ok=True)
    print("| family | scheduler | input | frames x height x width | steps | guidance | LoRA | max abs diff |")
    print("| --- | --- | --- | --- | ---: | --- | --- | ---: |")
    for family, scheduler, form, request, loras in CASES:
        model = fc.family_checkpoint(factory, family, scheduler)  # type: ignore[arg-type]
        image = fc.test_image(factory) if form else None  # type: ignore[arg-type]
        adapters = fc.lora_files(factory, model, loras)  # type: ignore[arg-type]
        with VideoGenerator.from_pretrained(model, executor="inline") as gen:
            for i, (path, strength, target) in enumerate(adapters):
                gen.set_lora_adapter(f"a{i}", path, strength=strength, target=target)
            ours = gen.generate(
                PROMPT, negative_prompt="blurry", image=_image_as(form, image), seed=5, save_video=False, **request
            )
        pipeline = "WanImageToVideoPipeline" if form else fc.DIFFUSERS_CLASS[family]
        ref = fc.diffusers_frames(
            model, pipeline, PROMPT, negative_prompt="blurry", image=image, seed=5, lora=adapters, **request
        )
        guidance = f"{request['guidance_scale']}" + (
            f" / {request['guidance_scale_2']}" if "guidance_scale_2" in request else ""
        )
        size = f"{request['num_frames']} x {request['height']} x {request['width']}"
        lora = ", ".join(f"{target} {strength}" for _, strength, target in loras) or "-"
        print(f"| {family} | {scheduler} | {f'image ({form})' if form else 'text'} | {size} | "
              f"{request['num_inference_steps']} | {guidance} | {lora} | {fc.max_abs_diff(ours.frames, ref)} |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
