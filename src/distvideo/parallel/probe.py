"""This machine's figures for the layout planner, measured instead of assumed (`distvideo plan --probe`).

The cost model (parallel/autolayout.py) prices a denoising step as matmul FLOPs at an achieved rate, a fixed cost per
transformer layer, and collectives at a latency and a bandwidth. The probe measures each on the CPU ranks of this
machine, in the cost model's own terms:

- **flops** and **layer_overhead**, for every thread count a rank can get here (cores / ranks per node): one
  transformer layer (self-attention with its projections, a 4x feed-forward, layer norms) timed at a small width,
  where its FLOPs are negligible (the overhead), and at a working size, where they dominate (medians of interleaved
  rounds, every thread count in each); the FLOPs are counted as the cost model counts them, so what the layer spends
  beside its matmuls (norms, softmax, activations) is in the rate.
- **collectives**, for every group size from 2 to the cores (powers of 2): gloo all-to-alls among that many processes
  on the loopback interface, each with its share of the cores, timed as sequence parallelism calls them, right after
  a layer: what a layer and a small all-to-all take over the layer alone (the latency, with the ranks' skew and the
  contention with the compute threads in it; the median of many back-to-back pairs), and what one of BANDWIDTH_BYTES
  per rank adds over that (the bandwidth of the bytes leaving a rank). The slowest rank's figures count: a collective
  waits for it.

The figures are kept in a JSON file (DISTVIDEO_PROBE_FILE, else ~/.cache/distvideo/probe.json) with the machine they
were measured on (host, CPU, cores, torch version); the planner reads them when they match this machine and falls back
to its documented assumptions otherwise. Measuring imports torch; reading the file does not.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distvideo import envs
from distvideo.errors import ConfigError
from distvideo.machine import available_cores, bind_gloo_to_loopback
from distvideo.paths import replace_file

PROBE_VERSION = 1
#: the two layer sizes: (tokens, width) where FLOPs are negligible, and where they dominate
OVERHEAD_SIZE = (16, 32)
WORK_SIZE = (512, 256)
BANDWIDTH_BYTES = 4 * 2**20
MAX_GROUP = 8
#: the layer between the collectives of the synchronised measurement
SYNCED_LAYER = (256, 256)
COLLECTIVE_TIMEOUT_S = 120


@dataclass(frozen=True)
class ProbeFigures:
    """What the probe measured: `flops` (achieved FLOP/s of a transformer layer) and `layer_overhead` (seconds per
    layer and forward) by threads per rank; `collectives`: group size -> (latency s, bandwidth bytes/s leaving one
    rank) of a gloo all-to-all; `machine`: where (probe_machine()); `measured`: when (ISO 8601, UTC)."""

    flops: dict[int, float]
    layer_overhead: dict[int, float]
    collectives: dict[int, tuple[float, float]]
    machine: dict[str, Any]
    measured: str
    version: int = PROBE_VERSION

    def for_threads(self, threads: float) -> tuple[float, float]:
        """(flops, layer_overhead) at the measured thread count nearest `threads` (a fraction of a core: scaled)."""
        nearest = min(self.flops, key=lambda t: (abs(t - threads), t))
        scale = min(1.0, threads / nearest)
        return self.flops[nearest] * scale, self.layer_overhead[nearest] / scale

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["collectives"] = {str(k): list(v) for k, v in self.collectives.items()}
        return data


def probe_path() -> Path:
    given = envs.get("DISTVIDEO_PROBE_FILE")
    return Path(given).expanduser() if given else Path.home() / ".cache" / "distvideo" / "probe.json"


def probe_machine() -> dict[str, Any]:
    """What the figures depend on: a file measured elsewhere (another host, CPU, core count or torch) is not used."""
    from importlib.metadata import version

    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "host": socket.gethostname(),
        "cpu": cpu or platform.processor(),
        "cores": available_cores(),
        "torch": version("torch"),
    }


def cached_probe() -> ProbeFigures | None:
    """The probe file's figures when it was measured on this machine; None without one (or for another machine).
    A file that is not a probe file is a ConfigError naming it."""
    path = probe_path()
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        figures = ProbeFigures(
            flops={int(k): float(v) for k, v in data["flops"].items()},
            layer_overhead={int(k): float(v) for k, v in data["layer_overhead"].items()},
            collectives={int(k): (float(v[0]), float(v[1])) for k, v in data["collectives"].items()},
            machine=dict(data["machine"]),
            measured=str(data["measured"]),
            version=int(data["version"]),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ConfigError(
            f"{path}: not a distvideo probe file ({type(exc).__name__}: {exc}); run `distvideo plan --probe` to "
            "measure again, or remove it"
        ) from None
    valid = figures.flops and set(figures.flops) == set(figures.layer_overhead)
    numbers = [
        *figures.flops.values(),
        *figures.layer_overhead.values(),
        *(x for v in figures.collectives.values() for x in v),
    ]
    if not valid or not all(math.isfinite(x) and x > 0 for x in numbers):
        raise ConfigError(f"{path}: a probe file with missing or non-positive figures; run `distvideo plan --probe`")
    if figures.version != PROBE_VERSION or figures.machine != probe_machine():
        return None
    return figures


def measure(*, rounds: int = 7, repeats: int = 7) -> ProbeFigures:
    """Measure this machine's figures (a few seconds on a small machine: the layers in `rounds` interleaved rounds, each
    collective `repeats` times over) and write them to the probe file."""
    import torch

    cores = available_cores()
    threads = sorted({max(1, cores // ranks) for ranks in range(1, cores + 1)})
    flops: dict[int, float] = {}
    overhead: dict[int, float] = {}
    before = torch.get_num_threads()
    small_runs: dict[int, list[float]] = {t: [] for t in threads}
    work_runs: dict[int, list[float]] = {t: [] for t in threads}
    try:  # in rounds, every thread count once per round: a slow spell of the machine falls on all of them
        small_layer, work_layer = _layer(*OVERHEAD_SIZE), _layer(*WORK_SIZE)
        for _ in range(rounds):
            for t in threads:
                torch.set_num_threads(t)
                small_runs[t].append(_seconds(small_layer, 8))
                work_runs[t].append(_seconds(work_layer, 3))
    finally:
        torch.set_num_threads(before)
    for t in threads:
        small, work = statistics.median(small_runs[t]), statistics.median(work_runs[t])
        overhead[t] = small
        flops[t] = layer_flops(*WORK_SIZE) / max(work - small, 1e-9)
    sizes = [s for s in (2, 4, 8) if s <= max(2, min(cores, MAX_GROUP))]
    collectives = {size: _collective_figures(size, repeats) for size in sizes}
    figures = ProbeFigures(
        flops=flops,
        layer_overhead=overhead,
        collectives=collectives,
        machine=probe_machine(),
        measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    path = probe_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, json.dumps(figures.to_json(), indent=1) + "\n")
    return figures


def layer_flops(tokens: int, width: int) -> float:
    """A layer's FLOPs as the cost model counts them: 2 x parameters x tokens (q, k, v, out: 4 w^2; the 4x
    feed-forward: 8 w^2) and 4 x tokens x keys x width of attention."""
    return 2 * 12 * width * width * tokens + 4 * tokens * tokens * width


def _layer(tokens: int, width: int) -> Callable[[], Any]:
    """One forward of a pre-norm transformer layer in float32 on random tokens, written as diffusers' video blocks
    are (separate projections, scaled_dot_product_attention, a GELU feed-forward), not torch's fused encoder layer."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    heads = max(1, width // 64)
    parts = nn.ModuleDict(
        {
            "norm1": nn.LayerNorm(width),
            "q": nn.Linear(width, width),
            "k": nn.Linear(width, width),
            "v": nn.Linear(width, width),
            "out": nn.Linear(width, width),
            "norm2": nn.LayerNorm(width),
            "up": nn.Linear(width, 4 * width),
            "down": nn.Linear(4 * width, width),
        }
    )
    x = torch.randn(1, tokens, width)

    @torch.inference_mode()
    def forward() -> torch.Tensor:
        h = parts["norm1"](x)
        q, k, v = (parts[n](h).unflatten(-1, (heads, -1)).transpose(1, 2) for n in ("q", "k", "v"))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        y = x + parts["out"](attended)
        out: torch.Tensor = y + parts["down"](F.gelu(parts["up"](parts["norm2"](y)), approximate="tanh"))
        return out

    return forward


def _seconds(call: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `call`, after two unmeasured calls."""
    times = []
    for n in range(repeats + 2):
        start = time.perf_counter()
        call()
        if n >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective_figures(size: int, repeats: int) -> tuple[float, float]:
    """(latency, bandwidth) of a gloo all-to-all among `size` processes on this machine, medians of `repeats`."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="distvideo-probe-") as folder:
        out = Path(folder) / "result.json"
        ranks = [
            context.Process(target=_collective_rank, args=(rank, size, str(Path(folder) / "store"), str(out), repeats))
            for rank in range(size)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=COLLECTIVE_TIMEOUT_S)
        failed = [p.exitcode for p in ranks if p.exitcode != 0]
        for process in ranks:
            if process.is_alive():
                process.kill()
        if failed or not out.is_file():
            raise RuntimeError(f"the collective probe of {size} processes failed (exit codes {failed})")
        latency, bandwidth = json.loads(out.read_text())
    return float(latency), float(bandwidth)


def _collective_rank(rank: int, size: int, store: str, out: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    bind_gloo_to_loopback()
    torch.set_num_threads(max(1, available_cores() // size))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        # between layers, as sequence parallelism calls them: what a layer and an all-to-all take over the layer
        # alone (the ranks' skew and the contention with the compute threads included), small and large
        layer = _layer(*SYNCED_LAYER)
        small, large = torch.zeros(size * 16), torch.zeros(BANDWIDTH_BYTES // 4)
        latency = max(_collective_seconds(layer, small, repeats * 30), 1e-9)
        moved = max(_collective_seconds(layer, large, repeats * 4) - latency, 1e-9)
        bandwidth = BANDWIDTH_BYTES * (size - 1) / size / moved
        mine = torch.tensor([latency, bandwidth], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(gathered, mine)
        if rank == 0:  # the slowest rank's figures: a collective waits for it
            latency = max(float(f[0]) for f in gathered)
            bandwidth = min(float(f[1]) for f in gathered)
            Path(out).write_text(json.dumps([latency, bandwidth]))
    finally:
        dist.destroy_process_group()


def _collective_seconds(layer: Callable[[], Any], tensor: Any, pairs: int) -> float:
    """What an all-to-all of `tensor` adds to a layer before it: the median over `pairs` of (a layer and the
    all-to-all) less (a layer alone), each pair timed back to back."""
    import torch
    import torch.distributed as dist

    output = torch.empty_like(tensor)
    added = []
    dist.barrier()
    for n in range(pairs + 2):
        start = time.perf_counter()
        layer()
        alone = time.perf_counter() - start
        start = time.perf_counter()
        layer()
        dist.all_to_all_single(output, tensor)
        if n >= 2:  # two warm-ups
            added.append(time.perf_counter() - start - alone)
    return statistics.median(added)
