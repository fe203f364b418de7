#!/usr/bin/env python
"""Train the demo model: a tiny Wan2.1-architecture text-to-video model that draws the shapes dataset's captions.

Stages (each resumable; ``all`` runs vae, latents, transformer and export in order, skipping the finished ones):

1. ``vae``: train a small ``AutoencoderKLWan`` (base_dim 12, z_dim 16) on crops (32 x 32, ``--vae-frames`` long)
   around the shape of clips of the shapes dataset (:mod:`distvideo.testing.shapes`) with L1 + MSE reconstruction
   (shape pixels weighted 5x) and a small KL term; ``--vae-deterministic`` decodes the posterior means instead of
   samples; a ``STOP_VAE`` file in the work folder freezes it at the next step;
2. ``latents``: encode a fixed set of 17-frame clips to VAE latents (posterior means) and measure the per-channel
   latent mean and std (written to the VAE config as ``latents_mean``/``latents_std``, as Wan's VAE carries them);
3. ``transformer``: train a small ``WanTransformer3DModel`` and the small UMT5 text encoder together with Wan's
   flow-matching objective (x_t = (1 - s) x0 + s eps, target eps - x0, s drawn uniformly and shifted by the
   scheduler's shift 3) with 10% of captions dropped to the empty prompt for classifier-free guidance, AdamW, and an
   EMA of the weights; the text is encoded exactly as ``WanPipeline.encode_prompt`` does (512 rows, zero padded);
   ``decoder`` (optional, beside it) goes on training the VAE's decoder with the encoder frozen;
4. ``export``: write a diffusers-format ``WanPipeline`` folder (the EMA transformer and text encoder in float32, the
   VAE in float16) with its ``distvideo_defaults.json`` into ``--out``; ``--from-checkpoints`` takes stages still
   running from their latest checkpoints (an interim look);
``check-vae``: the caption check on the VAE's own reconstructions of held-out clips, the ceiling of the whole model.

``--device cuda`` runs every stage on a GPU (random draws stay on CPU generators); docs/demo-model.md has the
command for a lent GPU, where the stages take minutes instead of hours.

Everything is seeded; losses go to ``WORK/log.jsonl`` and the console. Example (the command the shipped model was
trained with is in docs/demo-model.md)::

    python scripts/train_demo_model.py --work /tmp/demo-train all
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import numpy as np
import torch

from distvideo.testing import shapes
from distvideo.testing.checkpoints import build_tiny_wan

#: The demo model's architecture (keyword arguments of build_tiny_wan): a 128-wide transformer (4 heads x 32,
#: 4 layers) and a VAE of base width 12 (stored in float16).
DEMO_MODEL_CONFIG: dict[str, Any] = {
    "num_layers": 4,
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "ffn_dim": 512,
    "text_dim": 64,
    "vae_base_dim": 12,
    "z_dim": 16,
    "scheduler": "unipc",
    "seed": 5,
    "dtype": torch.float32,
    "vae_dtype": torch.float16,
    "vocab_size": 512,
    "text_num_heads": 2,
    "text_d_kv": 16,
    "text_d_ff": 128,
    "defaults": {"num_frames": 17, "height": 64, "width": 64, "num_inference_steps": 20, "guidance_scale": 5.0},
}
SEED = 20261201
VAE_DATA_SEED = 1
LATENT_DATA_SEED = 2
SHIFT = 3.0  # the scheduler's flow shift
CFG_DROPOUT = 0.1
#: where training runs (``--device``): the CPU, or a CUDA device, where every stage takes minutes instead of hours.
#: Random draws come from CPU generators on either, so the data and the noise do not depend on the device.
DEVICE = torch.device("cpu")
MAX_TEXT_TOKENS = 512  # the engine's (and WanPipeline's) max_sequence_length
LATENT_BATCH = 8  # clips encoded at once in the latents stage


def log(work: Path, **record: Any) -> None:
    record["time"] = round(time.time(), 1)
    with open(work / "log.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def to_tensor(frames: np.ndarray) -> torch.Tensor:
    """uint8 (T, H, W, 3) -> float (3, T, H, W) in [-1, 1]."""
    return torch.from_numpy(frames).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)


def load_checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True, map_location="cpu")


def skeleton(work: Path) -> Path:
    """A random-weight folder of the demo architecture: the components' configs, tokenizer and fixed text encoder."""
    path = work / "skeleton"
    if not (path / "model_index.json").is_file():
        build_tiny_wan(path, **DEMO_MODEL_CONFIG)
    return path


# ---------------------------------------------------------------------------------------------------------------------
VAE_FRAMES = 9  # 1 + 4 + 4: three latent frames, so the decoder's cache between chunks is trained too
VAE_CROP = 32  # the VAE is convolutional: it trains on crops around the shape (4x cheaper than whole 64 px frames)
FOREGROUND_WEIGHT = 5.0  # the shape is a small part of a frame: its pixels count this much more than background ones


def vae_batch(step: int, batch: int, num_frames: int = VAE_FRAMES) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``num_frames``-frame crops that contain the moving shape, and the per-pixel loss weights."""
    clips, weights = [], []
    for i in range(batch):
        index = step * batch + i
        caption, frames = shapes.sample_clip(VAE_DATA_SEED, index, num_frames=num_frames)
        rng = np.random.default_rng([VAE_DATA_SEED, index, 1])
        background = np.asarray(shapes.BACKGROUNDS[caption.background])
        foreground = np.abs(frames.astype(np.int16) - background).max(axis=-1) > 8  # (T, H, W)
        ys, xs = np.nonzero(foreground[int(rng.integers(num_frames))])
        size = frames.shape[1]
        cy = (ys.mean() if len(ys) else size / 2) + rng.uniform(-10, 10)
        cx = (xs.mean() if len(xs) else size / 2) + rng.uniform(-10, 10)
        top = int(np.clip(round(cy - VAE_CROP / 2), 0, size - VAE_CROP))
        left = int(np.clip(round(cx - VAE_CROP / 2), 0, size - VAE_CROP))
        crop = (slice(None), slice(top, top + VAE_CROP), slice(left, left + VAE_CROP))
        clips.append(to_tensor(frames[crop]))
        weights.append(torch.from_numpy(1.0 + (FOREGROUND_WEIGHT - 1.0) * foreground[crop].astype(np.float32)))
    return torch.stack(clips), torch.stack(weights)[:, None]


def train_vae(
    work: Path,
    steps: int,
    batch: int,
    lr: float,
    num_frames: int = VAE_FRAMES,
    deterministic: bool = False,
    minutes: float | None = None,
) -> None:
    """``minutes``: a time budget, as in :func:`train_transformer`."""
    from diffusers import AutoencoderKLWan

    out = work / "vae"
    if (out / "config.json").is_file():
        print("vae: done already")
        return
    vae = AutoencoderKLWan.from_pretrained(skeleton(work) / "vae", torch_dtype=torch.float32).to(DEVICE).train()
    ckpt = work / "vae_ckpt.pt"
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    start = 0
    if ckpt.is_file():
        state = load_checkpoint(ckpt)
        vae.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"]) + 1
    gen = torch.Generator().manual_seed(SEED)
    t0 = time.time()
    for step in range(start, steps):
        progress = step / steps
        if minutes is not None:
            progress = max(progress, (time.time() - t0) / (60 * minutes))
            if progress >= 1.0:
                break
        for group in opt.param_groups:  # cosine decay after a short warm-up
            warm = min(1.0, (step + 1) / 50)
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * progress))
        x, weight = (t.to(DEVICE) for t in vae_batch(step, batch, num_frames))
        post = vae.encode(x).latent_dist
        # deterministic: decode the posterior means, which is what the transformer's samples are decoded from
        z = (
            post.mean
            if deterministic
            else post.mean + post.std * torch.randn(post.mean.shape, generator=gen).to(DEVICE)
        )
        rec = vae.decode(z).sample
        l1 = ((rec - x).abs() * weight).mean()
        mse = ((rec - x).pow(2) * weight).mean()
        kl = post.kl().mean() / z[0].numel()
        loss = l1 + mse + 1e-4 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            log(
                work,
                stage="vae",
                step=step,
                l1=round(l1.item(), 5),
                mse=round(mse.item(), 6),
                kl=round(kl.item(), 4),
                s_per_step=round((time.time() - t0) / (step - start + 1), 3),
            )
        if step % 200 == 199:
            torch.save({"model": vae.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
        if (work / "STOP_VAE").exists():  # freeze the encoder here: the decoder stage goes on alone
            break
    vae.eval().save_pretrained(out, safe_serialization=True)


# ---------------------------------------------------------------------------------------------------------------------
DECODER_FRAMES = 17  # the whole clip: the decoder learns the later chunks too


def train_decoder(work: Path, steps: int, batch: int, lr: float) -> None:
    """Go on training the decoder alone, on whole-length clips, with the encoder frozen: the latents the transformer
    trains on stay valid, so this stage runs beside ``transformer``."""
    from diffusers import AutoencoderKLWan

    out = work / "vae_final"
    if (out / "config.json").is_file():
        print("decoder: done already")
        return
    vae = AutoencoderKLWan.from_pretrained(work / "vae", torch_dtype=torch.float32).to(DEVICE)
    vae.requires_grad_(False).eval()
    trained = [vae.decoder, vae.post_quant_conv]
    params = [p for m in trained for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    ckpt = work / "decoder_ckpt.pt"
    start = 0
    if ckpt.is_file():
        state = load_checkpoint(ckpt)
        vae.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"]) + 1
    t0 = time.time()
    for step in range(start, steps):
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        x, weight = (t.to(DEVICE) for t in vae_batch(100_000 + step, batch, num_frames=DECODER_FRAMES))
        with torch.no_grad():  # the posterior means: what the transformer learned to produce
            z = vae.encode(x).latent_dist.mean
        rec = vae.decode(z).sample
        l1 = ((rec - x).abs() * weight).mean()
        mse = ((rec - x).pow(2) * weight).mean()
        loss = l1 + mse
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            log(
                work,
                stage="decoder",
                step=step,
                l1=round(l1.item(), 5),
                mse=round(mse.item(), 6),
                s_per_step=round((time.time() - t0) / (step - start + 1), 3),
            )
        if step % 100 == 99:
            torch.save({"model": vae.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
        if (work / "STOP_DECODER").exists():  # the transformer finished first: stop at this step
            break
    vae.eval().save_pretrained(out, safe_serialization=True)


# ---------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def encode_latents(work: Path, count: int) -> None:
    from diffusers import AutoencoderKLWan

    out = work / "latents.pt"
    if out.is_file():
        print("latents: done already")
        return
    vae = AutoencoderKLWan.from_pretrained(work / "vae", torch_dtype=torch.float32).to(DEVICE).eval()
    lat, ids, l1 = [], [], []
    captions = [c.text for c in shapes.all_captions()]
    index = {c: i for i, c in enumerate(captions)}
    t0 = time.time()
    for first in range(0, count, LATENT_BATCH):
        clips = [shapes.sample_clip(LATENT_DATA_SEED, i) for i in range(first, min(first + LATENT_BATCH, count))]
        x = torch.stack([to_tensor(frames) for _, frames in clips]).to(DEVICE)
        mean = vae.encode(x).latent_dist.mean
        if first % 200 == 0:
            rec = vae.decode(mean[:1]).sample.clamp(-1, 1)
            l1.append((rec - x[:1]).abs().mean().item())
            log(work, stage="latents", item=first, recon_l1=round(l1[-1], 5), s=round(time.time() - t0, 1))
        lat.extend(mean.cpu())
        ids.extend(index[caption.text] for caption, _ in clips)
    latents = torch.stack(lat)
    ch_mean = latents.mean(dim=(0, 2, 3, 4))
    ch_std = latents.std(dim=(0, 2, 3, 4))
    torch.save(
        {
            "latents": latents,
            "ids": torch.tensor(ids),
            "mean": ch_mean,
            "std": ch_std,
            "captions": captions,
        },
        out,
    )
    log(
        work,
        stage="latents",
        count=count,
        recon_l1_mean=round(float(np.mean(l1)), 5),
        latents_mean=[round(v, 4) for v in ch_mean.tolist()],
        latents_std=[round(v, 4) for v in ch_std.tolist()],
    )


# ---------------------------------------------------------------------------------------------------------------------
class TextSide(torch.nn.Module):
    """The text encoder trained with the transformer, encoding exactly as ``WanPipeline.encode_prompt`` does: the
    UMT5 over the real tokens (attention mask), its output cut to each prompt's length and zero padded to 512 rows.
    (A fixed random encoder spread a colour word over sub-word tokens that a random network mixes with the rest of
    the caption: the transformer learned position and motion but not colour.)"""

    def __init__(self, skeleton_path: Path, captions: list[str]):
        super().__init__()
        from transformers import AutoTokenizer, UMT5EncoderModel

        self.encoder = UMT5EncoderModel.from_pretrained(skeleton_path / "text_encoder", torch_dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(skeleton_path / "tokenizer")
        tokens = tokenizer(captions, padding="longest", add_special_tokens=True, return_tensors="pt")
        self.register_buffer("ids", tokens.input_ids, persistent=False)
        self.register_buffer("mask", tokens.attention_mask, persistent=False)

    def forward(self, which: torch.Tensor) -> torch.Tensor:
        """Embeddings (len(which), 512, d) of the captions at indices ``which``, computed once per distinct one."""
        unique, inverse = torch.unique(which, return_inverse=True)
        mask = self.mask[unique]
        hidden = self.encoder(self.ids[unique], mask).last_hidden_state * mask[..., None]
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, MAX_TEXT_TOKENS - hidden.shape[1]))
        return hidden[inverse]


def optimizer_step(
    opt: torch.optim.Optimizer, model: torch.nn.Module, ema: torch.nn.Module, loss: torch.Tensor, step: int
) -> None:
    """One AdamW step on `loss` (gradients clipped at 1), then the EMA (decay ramping up to 0.999) that is exported."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    decay = min(0.999, (1 + step) / (10 + step))
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
            pe.lerp_(pm, 1 - decay)


def train_transformer(work: Path, steps: int, batch: int, lr: float, minutes: float | None = None) -> None:
    """``minutes``: a time budget; the learning rate follows whichever of steps and time is further along, and the
    stage ends when either runs out. The text encoder trains with the transformer (same optimiser and EMA)."""
    from diffusers import WanTransformer3DModel

    from distvideo.families.wan.text_padding import TextPaddingPlan

    out = work / "transformer"
    if (out / "config.json").is_file():
        print("transformer: done already")
        return
    data = torch.load(work / "latents.pt", weights_only=False)
    mean = data["mean"].view(1, -1, 1, 1, 1)
    std = data["std"].view(1, -1, 1, 1, 1)
    x0_all = (data["latents"] - mean) / std
    ids_all = data["ids"]
    captions = [*data["captions"], ""]
    empty = len(captions) - 1
    transformer = WanTransformer3DModel.from_pretrained(skeleton(work) / "transformer", torch_dtype=torch.float32)
    model = torch.nn.ModuleDict({"transformer": transformer, "text": TextSide(skeleton(work), captions)})
    model = model.to(DEVICE).train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    # exact: the zero padding rows of the text are one key counted r times (the engine's own plan, see text_padding)
    TextPaddingPlan().apply(transformer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    ckpt = work / "transformer_ckpt.pt"
    start = 0
    if ckpt.is_file():
        state = load_checkpoint(ckpt)
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"]) + 1
    gen = torch.Generator().manual_seed(SEED + 1)
    t0 = time.time()
    running = None
    for step in range(start, steps):
        progress = step / steps
        if minutes is not None:
            progress = max(progress, (time.time() - t0) / (60 * minutes))
            if progress >= 1.0:
                break
        for group in opt.param_groups:
            warm = min(1.0, (step + 1) / 200)
            group["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        pick = torch.randint(len(x0_all), (batch,), generator=gen)
        x0 = x0_all[pick].to(DEVICE)
        text = ids_all[pick].clone()
        text[torch.rand(batch, generator=gen) < CFG_DROPOUT] = empty
        u = torch.rand(batch, generator=gen)
        sigma = (SHIFT * u / (1 + (SHIFT - 1) * u)).to(DEVICE)
        noise = torch.randn(x0.shape, generator=gen).to(DEVICE)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        embeds = model["text"](text.to(DEVICE))
        pred = transformer(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=embeds, return_dict=False)[0]
        loss = (pred - (noise - x0)).pow(2).mean()
        optimizer_step(opt, model, ema, loss, step)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(
                work,
                stage="transformer",
                step=step,
                loss=round(loss.item(), 5),
                loss_avg=round(running, 5),
                s_per_step=round((time.time() - t0) / (step - start + 1), 3),
            )
        if step % 250 == 249:
            torch.save(
                {"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt
            )
        if (work / "STOP_TRANSFORMER").exists():  # stop at this step (the EMA is saved as it is)
            break
    ema["transformer"].save_pretrained(out, safe_serialization=True)
    ema["text"].encoder.save_pretrained(work / "text_encoder", safe_serialization=True)


# ---------------------------------------------------------------------------------------------------------------------
VAE_CHECK_SEED = 3  # held-out clips: neither the VAE stages nor the latents stage draw from this seed


@torch.no_grad()
def check_vae(work: Path, count: int) -> dict[str, Any]:
    """How well the VAE alone draws the captions: reconstruct ``count`` held-out 17-frame clips (through the posterior
    means) and judge each with the caption check the generated videos face. No transformer can beat this rate. Takes
    the newest of: the finished decoder, the decoder checkpoint, the VAE folder, the VAE checkpoint."""
    from diffusers import AutoencoderKLWan

    from distvideo.testing.video_check import check_video

    vae = AutoencoderKLWan.from_pretrained(skeleton(work) / "vae", torch_dtype=torch.float32)
    sources = [work / "vae_final", work / "decoder_ckpt.pt", work / "vae", work / "vae_ckpt.pt"]
    source = next(p for p in sources if p.exists())
    if source.suffix == ".pt":
        vae.load_state_dict(load_checkpoint(source)["model"])
    else:
        vae = AutoencoderKLWan.from_pretrained(source, torch_dtype=torch.float32)
    vae = vae.to(DEVICE).eval()
    passed, fg_l1, failures = 0, [], []
    for i in range(count):
        caption, frames = shapes.sample_clip(VAE_CHECK_SEED, i)
        x = to_tensor(frames)[None].to(DEVICE)
        rec = vae.decode(vae.encode(x).latent_dist.mean).sample.clamp(-1, 1)[0].cpu()
        out = rec.permute(1, 2, 3, 0).add(1).mul(127.5).round().to(torch.uint8).numpy()
        result = check_video(out, caption)
        passed += result.ok
        if not result.ok:
            failures.append(f"{caption.text}: {result.reason}")
        background = np.asarray(shapes.BACKGROUNDS[caption.background])
        shape = np.abs(frames.astype(np.int16) - background).max(axis=-1) > 8
        fg_l1.append(float(np.abs(out.astype(np.int16) - frames.astype(np.int16))[shape].mean()))
    report = {"source": source.name, "passed": passed, "count": count, "shape_l1_uint8": round(np.mean(fg_l1), 2)}
    log(work, stage="check-vae", **report, failures=failures)
    return report


# ---------------------------------------------------------------------------------------------------------------------
def export(work: Path, out: Path, from_checkpoints: bool = False) -> None:
    """Write the model folder. ``from_checkpoints``: take the transformer, the text encoder and the decoder from the
    latest checkpoints of stages still running (an interim look at the model; the finished stages' folders win)."""
    import shutil

    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    data = torch.load(work / "latents.pt", weights_only=False)
    folder = build_tiny_wan(out, **DEMO_MODEL_CONFIG)  # tokenizer, text encoder, scheduler, defaults, model_index
    final = work / "vae_final" if (work / "vae_final" / "config.json").is_file() else work / "vae"
    vae = AutoencoderKLWan.from_pretrained(final, torch_dtype=torch.float32)
    if from_checkpoints and final.name == "vae" and (work / "decoder_ckpt.pt").is_file():
        vae.load_state_dict(load_checkpoint(work / "decoder_ckpt.pt")["model"])
    vae.register_to_config(
        latents_mean=[round(v, 6) for v in data["mean"].tolist()],
        latents_std=[round(v, 6) for v in data["std"].tolist()],
    )
    shutil.rmtree(folder / "vae")
    torch.nn.Module.to(vae, torch.float16).save_pretrained(folder / "vae", safe_serialization=True)
    if (work / "transformer" / "config.json").is_file():
        transformer = WanTransformer3DModel.from_pretrained(work / "transformer", torch_dtype=torch.float32)
        text_encoder = UMT5EncoderModel.from_pretrained(work / "text_encoder", torch_dtype=torch.float32)
    elif from_checkpoints:
        ema = load_checkpoint(work / "transformer_ckpt.pt")["ema"]
        transformer = WanTransformer3DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32)
        transformer.load_state_dict({k.split(".", 1)[1]: v for k, v in ema.items() if k.startswith("transformer.")})
        text_encoder = UMT5EncoderModel.from_pretrained(folder / "text_encoder", torch_dtype=torch.float32)
        prefix = "text.encoder."
        text_encoder.load_state_dict({k[len(prefix) :]: v for k, v in ema.items() if k.startswith(prefix)})
    else:
        raise SystemExit(f"no trained transformer in {work}: run the transformer stage (or export --from-checkpoints)")
    for name, module in (("transformer", transformer), ("text_encoder", text_encoder)):
        shutil.rmtree(folder / name)
        module.save_pretrained(folder / name, safe_serialization=True)  # float32, as trained
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    log(work, stage="export", out=str(folder), total_bytes=total)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["vae", "latents", "transformer", "decoder", "export", "all", "check-vae"])
    parser.add_argument("--work", type=Path, required=True, help="working folder (checkpoints, latents, log.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="exported model folder (default: WORK/model)")
    parser.add_argument(
        "--from-checkpoints", action="store_true", help="export: take stages still running from their checkpoints"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the stages take minutes on a GPU)")
    parser.add_argument("--vae-steps", type=int, default=1500)
    parser.add_argument("--vae-batch", type=int, default=4)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--vae-frames", type=int, default=VAE_FRAMES, help="frames of the VAE's training crops")
    parser.add_argument(
        "--vae-deterministic", action="store_true", help="decode the posterior means (no sampling) while training"
    )
    parser.add_argument("--vae-minutes", type=float, default=None, help="time budget of the VAE stage")
    parser.add_argument("--check-clips", type=int, default=24, help="check-vae: held-out clips reconstructed")
    parser.add_argument("--decoder-steps", type=int, default=1500)
    parser.add_argument("--decoder-batch", type=int, default=2)
    parser.add_argument("--decoder-lr", type=float, default=5e-4)
    parser.add_argument("--clips", type=int, default=3000, help="17-frame clips encoded for the transformer stage")
    parser.add_argument("--dit-steps", type=int, default=6000)
    parser.add_argument("--dit-batch", type=int, default=32)
    parser.add_argument("--dit-lr", type=float, default=5e-4)
    parser.add_argument("--dit-minutes", type=float, default=None, help="time budget of the transformer stage")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 weights, TF32 products: fine for training
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(SEED)
    args.work.mkdir(parents=True, exist_ok=True)
    stages = ["vae", "latents", "transformer", "export"] if args.stage == "all" else [args.stage]
    for stage in stages:
        if stage == "vae":
            train_vae(
                args.work,
                args.vae_steps,
                args.vae_batch,
                args.vae_lr,
                args.vae_frames,
                args.vae_deterministic,
                args.vae_minutes,
            )
        elif stage == "latents":
            encode_latents(args.work, args.clips)
        elif stage == "decoder":
            train_decoder(args.work, args.decoder_steps, args.decoder_batch, args.decoder_lr)
        elif stage == "transformer":
            train_transformer(args.work, args.dit_steps, args.dit_batch, args.dit_lr, args.dit_minutes)
        elif stage == "check-vae":
            check_vae(args.work, args.check_clips)
        else:
            export(args.work, args.out or args.work / "model", args.from_checkpoints)
    return 0


if __name__ == "__main__":
    sys.exit(main())
