"""The image conditioning of Wan's image-to-video models, as diffusers' WanImageToVideoPipeline computes it.

- the image for the VAE: resized to the request's size (diffusers' VideoProcessor: Lanczos, no crop) and scaled to
  [-1, 1];
- the CLIP image tokens (Wan2.1 I2V): the CLIP image processor (resize the short side, centre crop, normalise) and
  the second-to-last hidden state of the CLIP vision model;
- the condition latents: the VAE's mean (no sampling) of the conditioning video, normalised with the VAE's latent
  statistics, and (Wan2.1 I2V, Wan2.2 I2V-A14B) the mask channels that mark the first frame as given.

Under a parallel layout rank 0 computes them and broadcasts the result (ParallelContext.computed_once), so every
rank holds the same bits and the encode runs once: on the 2-vCPU test machine that took 0.44-0.84x the wall time of
every rank encoding at once, whose encodes compete for the cores (benchmarks/conditioning.py; docs/families.md).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch


def pil_image(pixels: np.ndarray) -> Any:
    """The uint8 RGB array of a resolved request as the PIL image diffusers' processors take."""
    from PIL import Image

    return Image.fromarray(pixels)


def vae_image(image: Any, height: int, width: int, vae_scale_spatial: int) -> torch.Tensor:
    """(1, 3, height, width) float32 in [-1, 1]: diffusers' VideoProcessor.preprocess, as WanImageToVideoPipeline
    calls it."""
    from diffusers.video_processor import VideoProcessor

    processor = VideoProcessor(vae_scale_factor=vae_scale_spatial)
    return processor.preprocess(image, height=height, width=width).to(dtype=torch.float32)


@torch.no_grad()
def clip_image_tokens(encoder: Any, processor: Any, image: Any, device: torch.device) -> torch.Tensor:
    """The CLIP vision model's second-to-last hidden state for `image` (diffusers' encode_image)."""
    inputs = processor(images=image, return_tensors="pt").to(device)
    return encoder(**inputs, output_hidden_states=True).hidden_states[-2]


@torch.no_grad()
def condition_latents(
    vae: Any, video: torch.Tensor, latents_mean: torch.Tensor, latents_std_inverse: torch.Tensor
) -> torch.Tensor:
    """The VAE's mean latents of `video` (B, 3, T, H, W), in float32, normalised: (mean - latents_mean) * 1/std."""
    encoded = vae.encode(video.to(dtype=vae.dtype), return_dict=True).latent_dist.mode()
    encoded = encoded.to(dtype=torch.float32)
    return (encoded - latents_mean.to(encoded.device)) * latents_std_inverse.to(encoded.device)


def first_frame_video(image: torch.Tensor, num_frames: int) -> torch.Tensor:
    """(1, 3, num_frames, H, W): the image as the first frame, zeros after it (Wan2.1 I2V's conditioning video)."""
    image = image.unsqueeze(2)
    zeros = image.new_zeros(image.shape[0], image.shape[1], num_frames - 1, image.shape[3], image.shape[4])
    return torch.cat([image, zeros], dim=2)


def first_frame_mask(num_frames: int, latent_rows: int, latent_cols: int, temporal: int) -> torch.Tensor:
    """(1, temporal, latent frames, rows, cols): 1 where the frame is given (the first), 0 elsewhere; the first frame
    repeated `temporal` times so the pixel frames fold into the VAE's latent frames (diffusers, step for step)."""
    mask = torch.ones(1, 1, num_frames, latent_rows, latent_cols)
    mask[:, :, 1:] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
    mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
    return mask.view(1, -1, temporal, latent_rows, latent_cols).transpose(1, 2)


def tensor_digest(x: torch.Tensor | None) -> str | None:
    """sha256 of a tensor's dtype, shape and bytes (None for None): equal digests mean bit-identical tensors."""
    if x is None:
        return None
    data = x.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{data.dtype} {tuple(data.shape)}".encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
