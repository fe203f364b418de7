#!/usr/bin/env python
"""Distil the demo model (teacher: 20 UniPC steps, guidance 5) into a student that runs 4 Euler steps without
guidance: the demo model's few-step sibling, `demo-wan-4step` (docs/demo-model.md, "The 4-step model").

The recipe is trajectory (segment) distillation: the teacher's own 20-step guided trajectories are recorded at the
noise levels the student stops at (sigmas 0, 5, 10 and 15 of the teacher's 20, and the clean end), and the student,
initialised from the teacher, learns to cross each of the four segments in one Euler step of the conditional branch
alone: its velocity at the segment's start must equal (x_end - x_start) / (sigma_end - sigma_start) of the teacher's
trajectory. Guidance is folded into the student (the targets are the guided teacher's), so it runs one branch.

Stages (each resumable):

1. ``trajectories``: ``--seeds`` noise draws per caption of the grammar (168 captions), the teacher run through
   diffusers' ``WanPipeline`` in batches, its latents kept at the five stops;
2. ``train``: AdamW on the segment velocities (text encoder frozen, text embeddings computed once), an EMA of the
   weights, ``--minutes`` or ``--steps``, whichever runs out first;
3. ``export``: the demo model's folder with the student's transformer (float16: half the bytes; loaded back in
   float32) and a ``distvideo_defaults.json`` declaring the schedule (4 steps, euler, shift 3, the sigmas, guidance 1).

Everything is seeded; the losses go to ``WORK/log.jsonl``. The command the shipped student was made with is in
docs/demo-model.md::

    python scripts/distill_demo_model.py --work /tmp/distill all
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_demo_model: the teacher's logging and optimiser step

import numpy as np
import torch
from train_demo_model import log, optimizer_step

from distvideo.models.embedded import DEMO_MODEL_DIR
from distvideo.testing import shapes

SEED = 20261207
TEACHER_STEPS = 20
TEACHER_GUIDANCE = 5.0
STOPS = (0, 5, 10, 15)  # the teacher's step indices where the student's four steps start
SHIFT = 3.0  # the teacher scheduler's flow shift, which the student's Euler steps keep
BATCH = 56  # trajectories per teacher batch (168 captions = 3 batches per seed)


def unshifted_sigmas() -> list[float]:
    """The student's sigmas before the shift: the teacher's (UniPC with flow sigmas: linspace(1, 1/1000, 21)) at
    STOPS; the Euler scheduler shifts them to the teacher's own noise levels."""
    u = np.linspace(1.0, 1.0 / 1000, TEACHER_STEPS + 1)[:-1]
    return [round(float(u[i]), 6) for i in STOPS]


def shifted(u: float) -> float:
    return SHIFT * u / (1 + (SHIFT - 1) * u)


def teacher(device: torch.device) -> Any:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(DEMO_MODEL_DIR), torch_dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def caption_embeddings(pipe: Any, captions: list[str]) -> torch.Tensor:
    embeds = [pipe.encode_prompt(c, do_classifier_free_guidance=False, max_sequence_length=512)[0] for c in captions]
    return torch.cat(embeds)


@torch.no_grad()
def record_trajectories(work: Path, seeds: int, device: torch.device) -> None:
    out = work / "trajectories.pt"
    if out.is_file():
        print("trajectories: done already")
        return
    pipe = teacher(device)
    captions = [c.text for c in shapes.all_captions()]
    embeds = caption_embeddings(pipe, captions)
    empty = caption_embeddings(pipe, [""])
    shape = (16, 5, 8, 8)  # 17 frames of 64 x 64 in the demo VAE's latents
    states, ids = [], []
    t0 = time.time()
    for seed in range(seeds):
        for first in range(0, len(captions), BATCH):
            which = list(range(first, min(first + BATCH, len(captions))))
            gen = torch.Generator("cpu").manual_seed(SEED + 1000 * seed + first)
            noise = torch.randn((len(which), *shape), generator=gen)
            kept: list[torch.Tensor] = [noise.clone()]

            def keep(
                pipeline: Any, step: int, t: Any, kwargs: dict[str, Any], kept: list[torch.Tensor] = kept
            ) -> dict[str, Any]:
                if step + 1 in (*STOPS[1:], TEACHER_STEPS):
                    kept.append(kwargs["latents"].detach().cpu().clone())
                return kwargs

            pipe(
                prompt_embeds=embeds[which].to(device),
                negative_prompt_embeds=empty.expand(len(which), -1, -1).to(device),
                num_frames=17,
                height=64,
                width=64,
                num_inference_steps=TEACHER_STEPS,
                guidance_scale=TEACHER_GUIDANCE,
                latents=noise.to(device),
                output_type="latent",
                callback_on_step_end=keep,
            )
            states.append(torch.stack(kept, dim=1))  # (batch, 5, C, T, H, W)
            ids.extend(which)
        log(work, stage="trajectories", seed=seed, s=round(time.time() - t0, 1))
    torch.save({"states": torch.cat(states), "ids": torch.tensor(ids), "embeds": embeds.cpu()}, out)


def segment_sigmas() -> torch.Tensor:
    """The shifted noise levels of the five stops (the clean end is 0)."""
    return torch.tensor([shifted(u) for u in unshifted_sigmas()] + [0.0])


def train(work: Path, steps: int, minutes: float, batch: int, lr: float, device: torch.device) -> None:
    from diffusers import WanTransformer3DModel

    from distvideo.families.wan.text_padding import TextPaddingPlan

    out = work / "student"
    if (out / "config.json").is_file():
        print("train: done already")
        return
    data = torch.load(work / "trajectories.pt", weights_only=True)
    states, ids, embeds = data["states"], data["ids"], data["embeds"]
    sigmas = segment_sigmas()
    student = WanTransformer3DModel.from_pretrained(DEMO_MODEL_DIR / "transformer", torch_dtype=torch.float32)
    student = student.to(device).train()
    TextPaddingPlan().apply(student)  # exact: the zero text padding counted once (models/text_padding.py)
    ema = copy.deepcopy(student).eval().requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(SEED + 1)
    t0, running = time.time(), None
    for step in range(steps):
        progress = max(step / steps, (time.time() - t0) / (60 * minutes))
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        pick = torch.randint(len(states), (batch,), generator=gen)
        k = torch.randint(len(STOPS), (batch,), generator=gen)
        start, end = states[pick, k], states[pick, k + 1]
        s0, s1 = sigmas[k], sigmas[k + 1]
        target = (end - start) / (s1 - s0).view(-1, 1, 1, 1, 1)
        pred = student(
            hidden_states=start.to(device),
            timestep=(s0 * 1000).to(device),
            encoder_hidden_states=embeds[ids[pick]].to(device),
            return_dict=False,
        )[0]
        loss = (pred - target.to(device)).pow(2).mean()
        optimizer_step(opt, student, ema, loss, step)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0:
            log(work, stage="train", step=step, loss=round(loss.item(), 5), loss_avg=round(running, 5),
                s_per_step=round((time.time() - t0) / (step + 1), 3))  # fmt: skip
        if (work / "STOP").exists():
            break
    ema.save_pretrained(out, safe_serialization=True)


def export(work: Path, out: Path) -> None:
    """The demo model's folder with the student's transformer and the declared few-step schedule."""
    from diffusers import WanTransformer3DModel

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(DEMO_MODEL_DIR, out, ignore=shutil.ignore_patterns("distvideo_cache_ratios.json"))
    student = WanTransformer3DModel.from_pretrained(work / "student", torch_dtype=torch.float32)
    shutil.rmtree(out / "transformer")
    torch.nn.Module.to(student, torch.float16).save_pretrained(out / "transformer", safe_serialization=True)
    defaults = json.loads((DEMO_MODEL_DIR / "distvideo_defaults.json").read_text())
    defaults.update(
        num_inference_steps=len(STOPS), guidance_scale=1.0, scheduler="euler", flow_shift=SHIFT,
        sigmas=unshifted_sigmas(),
    )  # fmt: skip
    (out / "distvideo_defaults.json").write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(work, stage="export", out=str(out), total_bytes=total)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["trajectories", "train", "export", "all"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None, help="export: the model folder (default WORK/model)")
    parser.add_argument("--seeds", type=int, default=12, help="noise draws per caption")
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    device = torch.device(args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage in ("trajectories", "all"):
        record_trajectories(args.work, args.seeds, device)
    if args.stage in ("train", "all"):
        train(args.work, args.steps, args.minutes, args.batch, args.lr, device)
    if args.stage in ("export", "all"):
        export(args.work, args.out or args.work / "model")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
