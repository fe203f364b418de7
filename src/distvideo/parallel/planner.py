"""The automatic layout for a checkpoint: its JSON files and safetensors headers (never the weights), a request
(the model's defaults when the engine chooses) and the device's figures, turned into the cost model's numbers
(parallel/autolayout.py) and its choice. Imports no torch: `distvideo plan` and the engine's resolution run it before
any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distvideo import envs
from distvideo.config import EngineConfig, Naming
from distvideo.errors import ConfigError
from distvideo.machine import available_cores
from distvideo.models.family import IMAGE_REQUIRED
from distvideo.models.memory import estimate_request
from distvideo.models.registry import ModelInfo
from distvideo.parallel.autolayout import Hardware, ModelFigures, Plan, RequestFigures, plan_layout
from distvideo.parallel.layout import ParallelLayout, resolve_layout
from distvideo.parallel.probe import ProbeFigures, cached_probe
from distvideo.request import GenerationRequest, ResolvedRequest, is_guided

#: the options that make a layout explicit: any of them given, the rules of parallel/layout.py fill the rest
LAYOUT_OPTIONS = ("sp_size", "ulysses_size", "ring_size", "cfg_parallel", "replicas", "shard_weights")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
_BLOCK = re.compile(r"^(.*?blocks\.\d+)\.")

# Device figures: assumptions, documented in docs/parallel.md ("Automatic layout"). CPU: about 50 GFLOP/s of float32
# matmuls per core (the benchmark checkpoint's forwards on one thread, docs/bench.md), gloo over loopback or a
# 10 GbE link; CUDA: an H100/H200-class GPU in bf16 at about 40% of its dense peak, NVLink inside a node, one
# 200 Gb/s NIC per GPU across nodes.
CPU_CORE_FLOPS = 50e9
#: one CPU core's figures (flops per core; the memory and ranks per node are the machine's)
CPU_FIGURES = Hardware(
    "cpu", CPU_CORE_FLOPS, 0, 1e9, 1e9, latency=200e-6, layer_overhead=1e-3, block_overhead=250e-6, ranks_per_node=1
)
CUDA_MEMORY_BYTES = 80 * 2**30
CUDA_FIGURES = Hardware(
    "cuda",
    400e12,
    CUDA_MEMORY_BYTES,
    150e9,
    25e9,
    latency=20e-6,
    layer_overhead=50e-6,
    block_overhead=20e-6,
    ranks_per_node=1,
)


@dataclass(frozen=True)
class AutoLayout:
    layout: ParallelLayout
    shard_weights: str
    plan: Plan | None  # None: the layout was given (explicit options win)


def layout_is_explicit(config: EngineConfig) -> bool:
    """Whether the user gave any layout option, or asked for the fixed rules (`layout="rules"`)."""
    return config.layout == "rules" or any(getattr(config, name) is not None for name in LAYOUT_OPTIONS)


def device_kind(device: str | None) -> str:
    """ "cuda" or "cpu": the requested device's type, else whether this machine has an NVIDIA driver with a GPU
    (read from /proc, without importing torch) that CUDA_VISIBLE_DEVICES does not hide ("" or "-1": none)."""
    if device:
        return "cuda" if device.startswith("cuda") else "cpu"
    visible = envs.get_raw("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "cpu"
    gpus = Path("/proc/driver/nvidia/gpus")
    return "cuda" if gpus.is_dir() and any(gpus.iterdir()) else "cpu"


def device_figures(kind: str, ranks_per_node: int, memory_bytes: int | None = None) -> Hardware:
    """The figures of one rank: CPU ranks share the node's cores and memory; a CUDA rank has its GPU (its memory from
    nvidia-smi when present, else an 80 GiB H100-class default). `memory_bytes` overrides the memory per rank."""
    if kind == "cuda":
        memory = memory_bytes or _nvidia_smi_memory() or CUDA_MEMORY_BYTES
        return dataclasses.replace(CUDA_FIGURES, memory_bytes=memory, ranks_per_node=ranks_per_node)
    return cpu_figures(ranks_per_node, memory_bytes, cached_probe())


def cpu_figures(ranks_per_node: int, memory_bytes: int | None, probed: ProbeFigures | None) -> Hardware:
    """One CPU rank's figures: the rank's share of the cores and memory, at the probe's measured rates when there is
    a probe of this machine, else at the documented assumptions."""
    cores = available_cores()
    threads = cores / ranks_per_node if ranks_per_node > cores else cores // ranks_per_node
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    memory = memory_bytes or ram // ranks_per_node
    cpu = dataclasses.replace(
        CPU_FIGURES, flops=CPU_CORE_FLOPS * threads, memory_bytes=memory, ranks_per_node=ranks_per_node
    )
    if probed is None:
        return cpu
    flops, overhead = probed.for_threads(threads)
    collectives = tuple((size, lat, bw) for size, (lat, bw) in sorted(probed.collectives.items()))
    return dataclasses.replace(cpu, flops=flops, layer_overhead=overhead, collectives=collectives, source="probed")


def _nvidia_smi_memory() -> int | None:
    """The first GPU's total memory in bytes, or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return int(float(out.split()[0]) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _tensor_counts(folder: Path) -> dict[str, int]:
    """Parameter count per tensor name of every *.safetensors file in `folder` (headers only)."""
    counts: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                counts[name] = math.prod(entry["shape"])
    return counts


def _params(model: ModelInfo, name: str) -> int:
    folder = model.path / name
    return sum(_tensor_counts(folder).values()) if folder.is_dir() else 0


def model_figures(
    model: ModelInfo,
    dtype_bytes: int,
    *,
    text_on_device: bool = True,
    quantize: str | None = None,
    quantize_text_encoder: str | None = None,
) -> ModelFigures:
    """The cost model's view of a checkpoint: the first transformer's shape and parameters (its largest block
    too), and the bytes of the components held beside it; an 8-bit `quantize` mode holds a transformer parameter
    in one byte, `quantize_text_encoder` a text encoder's."""
    cfg = model.transformer_config
    counts = _tensor_counts(model.path / "transformer")
    blocks: dict[str, int] = {}
    for name, n in counts.items():
        match = _BLOCK.match(name)
        if match:
            blocks[match.group(1)] = blocks.get(match.group(1), 0) + n
    heads = int(cfg.get("num_attention_heads", model.num_attention_heads))
    text_bytes = 1 if quantize_text_encoder not in (None, "none") else dtype_bytes
    text = sum(_params(model, name) for name in ("text_encoder", "text_encoder_2")) * text_bytes
    return ModelFigures(
        heads=model.num_attention_heads,
        layers=int(cfg.get("num_layers", 1)),
        hidden=heads * int(cfg.get("attention_head_dim", 128)),
        transformer_params=sum(counts.values()),
        block_params=max(blocks.values(), default=0),
        experts=model.family.experts,
        text_encoder_bytes=text if text_on_device else 0,
        other_bytes=_params(model, "vae") * 4 + _params(model, "image_encoder") * 4,
        dtype_bytes=dtype_bytes,
        text_tokens=model.family.text_tokens,
        weight_bytes=1 if quantize not in (None, "none") else 0,
    )


def default_request(model: ModelInfo, naming: Naming | None = None, **given: Any) -> ResolvedRequest:
    """The request the engine plans for: the model's defaults (size, frames, guidance) under the `given` fields,
    resolved as generate resolves one; an image-to-video family gets a placeholder image (it does not change the
    layout, and is never read)."""
    image = "(placeholder)" if model.family.image == IMAGE_REQUIRED else None
    request = GenerationRequest(prompt="plan", image=image, **given, naming=naming or Naming())
    return model.resolve_request(request, read_image=False)


def request_figures(model: ModelInfo, request: ResolvedRequest, dtype_bytes: int) -> RequestFigures:
    """One request's tokens, guidance and memory on a rank holding all of it (models/memory.py's estimate)."""
    _, channels, frames, rows, cols = model.latent_shape(request)
    p_t, p_h, p_w = model.patch_size
    whole = estimate_request(model, request, dtype_bytes=dtype_bytes)
    return RequestFigures(
        tokens=(frames // p_t) * (rows // p_h) * (cols // p_w),
        guided=is_guided(request),
        latent_bytes=channels * frames * rows * cols * 4,
        activation_bytes=whole.transformer_bytes,
        decode_bytes=whole.decode_bytes,
        video_bytes=whole.video_bytes,
        max_bands=rows // 2 if rows >= 4 else 1,  # bands of at least MIN_BAND_ROWS (parallel/vae.py) latent rows
    )


def plan_for(
    model: ModelInfo,
    request: ResolvedRequest,
    world: int,
    *,
    ranks_per_node: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    memory_bytes: int | None = None,
    objective: str = "latency",
    can_shard: bool = True,
    text_on_device: bool = True,
    quantize: str | None = None,
    quantize_text_encoder: str | None = None,
) -> Plan:
    """The cost model's plan for `request` on `world` ranks, `ranks_per_node` of them per node (default: all); with
    a `quantize` mode the weights as held in 8 bits."""
    per_node = ranks_per_node or world
    if per_node < 1 or world % per_node:
        raise ConfigError(f"ranks per node ({per_node}) must divide the world size ({world})")
    kind = device_kind(device)
    dtype_bytes = DTYPE_BYTES[dtype] if dtype else (2 if kind == "cuda" else 4)
    figures = model_figures(
        model,
        dtype_bytes,
        text_on_device=text_on_device,
        quantize=quantize,
        quantize_text_encoder=quantize_text_encoder,
    )
    hardware = device_figures(kind, per_node, memory_bytes)
    wanted = request_figures(model, request, dtype_bytes)
    return plan_layout(figures, wanted, hardware, world, objective=objective, can_shard=can_shard)


def auto_layout(
    config: EngineConfig,
    model: ModelInfo,
    world: int,
    ranks_per_node: int | None = None,
    objective: str = "latency",
) -> AutoLayout:
    """The engine's layout: the options given (the rules of parallel/layout.py fill the rest), or with none given
    the cost model's choice for the model's default request (`layout="auto"`), by `objective`: "latency" for one
    request at a time, "throughput" for an engine that runs many (a batch, a service: replicas count). One rank has
    one layout: no plan (and no header read or device query) for it."""
    if layout_is_explicit(config) or world == 1:
        cfg_parallel = config.cfg_parallel
        if cfg_parallel is None and not is_guided(default_request(model)):  # one branch: no CFG halves by the rules
            cfg_parallel = False
        layout = resolve_layout(
            world,
            sp_size=config.sp_size,
            cfg_parallel=cfg_parallel,
            num_heads=model.num_attention_heads,
            replicas=config.replicas,
            ulysses_size=config.ulysses_size,
            ring_size=config.ring_size,
        )
        return AutoLayout(layout, config.shard_weights or "none", None)
    quantized = any(mode not in (None, "none") for mode in (config.quantize, config.quantize_text_encoder))
    blocked = bool(config.compile) or config.offload not in (None, "none") or quantized
    plan = plan_for(
        model,
        default_request(model),
        world,
        ranks_per_node=ranks_per_node if ranks_per_node and world % ranks_per_node == 0 else None,
        device=config.device,
        dtype=config.dtype,
        can_shard=not blocked,
        text_on_device=config.offload in (None, "none"),
        objective=objective,
        quantize=config.quantize,
        quantize_text_encoder=config.quantize_text_encoder,
    )
    s = plan.chosen.shape
    layout = ParallelLayout(
        world_size=world,
        sp_size=s.sp,
        cfg_degree=s.cfg,
        num_heads=model.num_attention_heads,
        replicas=s.replicas,
        ring_size=s.ring,
    )
    return AutoLayout(layout, s.shard, plan)
