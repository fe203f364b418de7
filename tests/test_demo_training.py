"""scripts/train_demo_model.py, the demo model's training recipe (issue 18), run end to end with tiny step counts:
every stage logs finite losses, the export is a folder the engine generates from, and the text side the transformer
trains against encodes exactly as diffusers' ``WanPipeline.encode_prompt`` does. So the recipe cannot rot between
the rare sessions with the hours of CPU (or the GPU) that training takes."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from distvideo import VideoGenerator

from background import FolderJob, run_program
from conftest import REPO

SCRIPT = REPO / "scripts" / "train_demo_model.py"
pytestmark = pytest.mark.slow  # every test reads one whole training run (about 10 s): not in `make test-fast`


def _load_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _train(work: Path, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), "all", "--work", str(work), "--threads", "1", "--vae-steps", "2"]
    cmd += ["--vae-frames", "5", "--vae-batch", "1", "--vae-deterministic", "--clips", "8", "--dit-steps", "2"]
    cmd += ["--dit-batch", "4"]
    return run_program(cmd, threading.Event(), 300, env={**environ, "HF_HUB_OFFLINE": "1"})


# a whole training run (about 8 s) whose files are all the tests read: in the background (background.py)
TRAINING = FolderJob("the demo model's training, every stage in small", "demo-train", _train)
BACKGROUND_JOBS = {"trained": TRAINING.hooks}


@pytest.fixture(scope="module")
def trained() -> Path:
    work, proc = TRAINING.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work


def test_every_stage_logs_and_the_export_generates(trained: Path) -> None:
    records = [json.loads(line) for line in (trained / "log.jsonl").read_text().splitlines()]
    stages = {r["stage"] for r in records} - {"check-vae"}  # another test of this module may have logged one
    assert stages == {"vae", "latents", "transformer", "export"}, stages
    losses = [r[k] for r in records for k in ("l1", "mse", "loss") if k in r]
    assert losses and all(math.isfinite(v) for v in losses)
    export = next(r for r in records if r["stage"] == "export")
    assert export["total_bytes"] < 20 * 2**20  # the limit for the shipped folder

    model = trained / "model"
    latents = torch.load(trained / "latents.pt", weights_only=False)
    vae_config = json.loads((model / "vae" / "config.json").read_text())
    assert vae_config["latents_std"] == pytest.approx(latents["std"].tolist(), rel=1e-5)  # the measured statistics
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        res = gen.generate("a red ball moving right on a black background", num_frames=5, height=32, width=32,
                           num_inference_steps=2, save_video=False)  # fmt: skip
    assert res.frames is not None and res.frames.shape == (5, 32, 32, 3)


def test_the_text_encoder_trains_and_encodes_as_the_pipeline_does(trained: Path) -> None:
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    exported = load_file(trained / "model" / "text_encoder" / "model.safetensors")
    initial = load_file(trained / "skeleton" / "text_encoder" / "model.safetensors")
    assert any(not torch.equal(exported[k], initial[k]) for k in initial), "the text encoder did not train"

    script = _load_script()
    from distvideo.testing.shapes import all_captions

    captions = [c.text for c in all_captions()[:5]] + [""]
    side = script.TextSide(trained / "model", captions)
    pipe = WanPipeline.from_pretrained(trained / "model", torch_dtype=torch.float32)
    which = torch.tensor([0, 3, 5, 3])
    with torch.no_grad():
        mine = side(which)
        ref = torch.cat(
            [
                pipe.encode_prompt(captions[i], do_classifier_free_guidance=False, max_sequence_length=512)[0]
                for i in which
            ]
        )
    assert mine.shape == ref.shape == (4, 512, side.encoder.config.d_model)
    # the same arithmetic up to float rounding (the batch is padded to its longest caption, the pipeline to 512)
    print(f"FIGURE training-time text encoding vs encode_prompt: max abs difference {(mine - ref).abs().max():.1e}")
    assert (mine - ref).abs().max() <= 1e-5
    assert torch.equal(mine == 0, ref == 0)  # the same zero padding rows


def test_check_vae_judges_the_reconstructions_of_held_out_clips(trained: Path) -> None:
    from distvideo.testing.shapes import sample_clip
    from distvideo.testing.video_check import check_video

    script = _load_script()
    held_out = [sample_clip(script.VAE_CHECK_SEED, i) for i in range(2)]
    # the clips themselves pass the caption check: a reconstruction that failed it was judged, not the clip
    assert all(check_video(frames, caption).ok for caption, frames in held_out)
    report = script.check_vae(trained, 2)
    # two training steps on 5-frame clips reconstruct no 17-frame clip well enough to pass: each held-out clip is
    # judged, in order, and fails with the check's reason
    assert report["source"] == "vae" and report["count"] == 2 and report["passed"] == 0, report
    assert report["shape_l1_uint8"] > 0
    logged = [json.loads(line) for line in (trained / "log.jsonl").read_text().splitlines()]
    assert logged[-1]["stage"] == "check-vae" and logged[-1]["passed"] == report["passed"], logged[-1]
    failures = logged[-1]["failures"]
    assert [f.split(": ", 1)[0] for f in failures] == [caption.text for caption, _ in held_out], failures
    assert all(f.split(": ", 1)[1] for f in failures), failures
