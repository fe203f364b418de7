"""Few-step ("distilled") Wan weights as users get them, with random weights, for tests and examples.

- :func:`build_fastwan_style`: a diffusers-format Wan2.1 text-to-video checkpoint laid out as FastVideo publishes its
  DMD-distilled FastWan2.1-T2V-1.3B-Diffusers: diffusers' ``FlowMatchEulerDiscreteScheduler`` with flow shift 8, and a
  ``distvideo_defaults.json`` declaring what the model card asks for: 3 steps at the DMD timesteps 1000, 757 and 522,
  without classifier-free guidance. A plain request on it runs that schedule.
- :func:`build_step_distill_lora`: a LoRA file in the naming LightX2V publishes its StepDistill-CfgDistill LoRAs in
  (the original Wan keys ``diffusion_model.blocks.N.self_attn.q.lora_down.weight`` / ``lora_up.weight`` / ``alpha``
  on every block's linear layers, rank 32 as their ``_rank32`` files), to run with :data:`LIGHTX2V_STEP_DISTILL`:
  4 steps at timesteps 1000, 750, 500, 250, flow shift 5, Euler, guidance 1.

Sampling follows diffusers' Euler step at those timesteps (FastVideo's own DMD sampler re-noises between steps);
the parity tests compare with diffusers' ``WanPipeline`` built with the same scheduler and timesteps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distvideo.testing.checkpoints import EMBEDDED_MODEL_CONFIG, build_tiny_wan
from distvideo.testing.lora_files import build_random_lora

#: FastWan2.1-T2V-1.3B's published sampling (its model card: 3 DMD steps, flow shift 8, no guidance)
FASTWAN_TIMESTEPS = [1000, 757, 522]
FASTWAN_FLOW_SHIFT = 8.0
FASTWAN_DEFAULTS: dict[str, Any] = {
    "num_frames": 17,
    "height": 64,
    "width": 64,
    "num_inference_steps": len(FASTWAN_TIMESTEPS),
    "guidance_scale": 1.0,
    "timesteps": FASTWAN_TIMESTEPS,
}
#: LightX2V's StepDistill-CfgDistill LoRAs: their config's denoising_step_list, sample_shift and guidance, as the
#: request fields that run them (the scheduler: diffusers' flow-matching Euler)
LIGHTX2V_STEP_DISTILL: dict[str, Any] = {
    "num_inference_steps": 4,
    "guidance_scale": 1.0,
    "scheduler": "euler",
    "flow_shift": 5.0,
    "timesteps": [1000, 750, 500, 250],
}
LIGHTX2V_LORA_RANK = 32


def build_fastwan_style(out_dir: str | Path, *, seed: int = 5) -> Path:
    """The tiny model's shapes with a FastWan-style scheduler and declared schedule (see the module doc)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = {**EMBEDDED_MODEL_CONFIG, "seed": seed, "defaults": FASTWAN_DEFAULTS}
    out = build_tiny_wan(out_dir, **config)
    scheduler: Any = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=FASTWAN_FLOW_SHIFT)
    scheduler.save_pretrained(out / "scheduler")
    return out


def build_step_distill_lora(model_dir: str | Path, path: str | Path, *, seed: int = 0) -> Path:
    """A random LoRA for the checkpoint at `model_dir` in LightX2V's key naming and rank (alpha = rank)."""
    return build_random_lora(
        model_dir,
        path,
        layout="wan",
        rank=LIGHTX2V_LORA_RANK,
        seed=seed,
        alpha=float(LIGHTX2V_LORA_RANK),
        magnitude=0.3,
    )
