"""How much memory a request needs on a rank, estimated from the model's configuration before any work, so a request
that cannot fit is refused (ConfigError, exit 2) instead of being killed by the kernel's out-of-memory killer.

The estimate counts what a request adds to a rank whose weights are already loaded (the activations): the larger of
the transformer's working set (tokens x width, the attention runs without materialising scores) and the VAE decode's,
which dominates for video. The Wan decoder runs frame by frame with a cache of two frames per causal convolution, so
its working set grows with the pixels of a frame and the decoder's base width, not with the frame count; the output
rank also holds the decoded video in float32 and its uint8 frames. The constants below were fitted to peak resident
memory measured on CPU (float32) with three decoders of base width 4, 8 and 16 at 256x256 to 768x768 and 9 to 33
frames (`tests/test_memory.py` checks the estimate within 30% of fresh measurements).

With offload (the `offload` engine option, pipelines/offload.py) the text encoder, image encoder or VAE wait in host
memory between requests, so the memory available when the request is checked does not hold them: the stage that
uses one brings its weights back onto the device, and the estimate adds them to that stage (the VAE's to the
decode, an encoder's to its own stage, where the activations are small beside its weights). On the CPU nothing
moves and nothing is added. With sharded weights (`--shard-weights`) a rank holds a share of each block between
steps, and while the transformer runs also the full parameters of two blocks (the running one and the prefetched
next) and of the layers outside the blocks: the estimate adds those to the transformer's stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from distvideo.models.registry import ModelInfo
from distvideo.request import ResolvedRequest

#: bytes per output pixel per channel of the decoder's base width, for the decode's working set (caches included)
DECODE_BYTES_PER_PIXEL_CHANNEL = 250
#: bytes per output pixel per frame the output rank holds for the decoded video (float32 RGB and one working copy)
VIDEO_BYTES_PER_PIXEL_FRAME = 24
#: float32 copies of a (tokens x width) tensor alive at once inside a transformer block, and of (tokens x ffn width)
TOKEN_WIDTH_COPIES, TOKEN_FFN_COPIES = 10, 2
#: fraction of the available memory a request may take (the rest is headroom for the estimate's error)
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class MemoryEstimate:
    transformer_bytes: int
    decode_bytes: int
    video_bytes: int
    vae_weight_bytes: int = 0  # the offloaded VAE's weights, back on the device for the decode
    encoder_weight_bytes: int = 0  # the larger offloaded encoder's weights, on the device for its stage

    @property
    def total(self) -> int:
        """The transient peak of one request on this rank (the stages run one after the other)."""
        return max(
            self.transformer_bytes,
            self.decode_bytes + self.video_bytes + self.vae_weight_bytes,
            self.encoder_weight_bytes,
        )

    def describe(self) -> str:
        offloaded = ""
        if self.vae_weight_bytes or self.encoder_weight_bytes:
            offloaded = (
                f"; offloaded weights back on the device for their stage: VAE {_gib(self.vae_weight_bytes)}, "
                f"encoder {_gib(self.encoder_weight_bytes)}"
            )
        return (
            f"about {_gib(self.total)} (decode {_gib(self.decode_bytes)} + video {_gib(self.video_bytes)}, "
            f"transformer {_gib(self.transformer_bytes)}{offloaded})"
        )


def estimate_request(
    model: ModelInfo,
    request: ResolvedRequest,
    *,
    sp_size: int = 1,
    decode_bands: int = 1,
    output_rank: bool = True,
    dtype_bytes: int = 4,
    offloaded: Mapping[str, int] | None = None,
    gathered: int = 0,
) -> MemoryEstimate:
    """The activations of `request` on one rank: its share of the tokens under sequence parallelism, its band of rows
    under the banded decode, the video only on the output rank. `dtype_bytes`: the transformer's dtype. `offloaded`:
    the weight bytes each offloaded component brings onto the device for its stage (ComponentOffload's
    `device_bytes_per_visit`: "text_encoder", "image_encoder", "vae"). `gathered`: under sharded weights, the bytes
    of full parameters a rank holds at once while the transformer runs (parallel/shard.py `gathered_bytes`)."""
    _, _, frames, rows, cols = model.latent_shape(request)
    p_t, p_h, p_w = model.patch_size
    tokens = math.ceil((frames // p_t) * (rows // p_h) * (cols // p_w) / sp_size)
    cfg = model.transformer_config
    width = int(cfg.get("num_attention_heads", 1)) * int(cfg.get("attention_head_dim", 64))
    ffn = int(cfg.get("ffn_dim", 4 * width))
    transformer = tokens * (TOKEN_WIDTH_COPIES * width + TOKEN_FFN_COPIES * ffn) * dtype_bytes
    pixels = request.height * request.width
    base = int(model.vae_config.get("base_dim", 96))
    decode = DECODE_BYTES_PER_PIXEL_CHANNEL * base * pixels // max(1, decode_bands)
    video = VIDEO_BYTES_PER_PIXEL_FRAME * request.num_frames * pixels if output_rank else 0
    weights = offloaded or {}
    return MemoryEstimate(
        transformer_bytes=transformer + gathered,
        decode_bytes=decode,
        video_bytes=video,
        vae_weight_bytes=weights.get("vae", 0),
        encoder_weight_bytes=max(weights.get("text_encoder", 0), weights.get("image_encoder", 0)),
    )


def fitting_size(model: ModelInfo, request: ResolvedRequest, estimate: int, limit: int) -> tuple[int, int]:
    """The largest (height, width) of the request's aspect, in steps of the model's stride, whose estimate would fit
    `limit` (the decode's memory grows with the pixels)."""
    stride = model.spatial_stride
    scale = math.sqrt(max(limit, 1) / max(estimate, 1)) * 0.95
    height = max(stride, int(request.height * scale) // stride * stride)
    width = max(stride, int(request.width * scale) // stride * stride)
    return height, width


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
