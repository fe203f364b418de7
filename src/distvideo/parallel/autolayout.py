"""The automatic layout's cost model: every layout (replicas x cfg x ulysses x ring, weight sharding) a world of ranks
could run for one model and request, with its estimated time per denoising step, memory per rank and why, and the
choice among them. Pure arithmetic on plain numbers, so each rule can be checked with a table; the formulas and the
decision rules are written down in docs/parallel.md ("Automatic layout"). Reading a checkpoint and a device into
these numbers is parallel/planner.py's job.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SHARD_LEVELS = ("none", "transformer", "all")  # the order of preference: shard only what memory requires
OBJECTIVES = ("latency", "throughput")
#: estimates within this fraction of the fastest count as equal (closer than a run tells layouts apart on a quiet machine,
#: docs/parallel.md "Checking the estimates"); the preferences decide then
NEAR = 0.10
#: fraction of a device's memory a layout may plan to use (models/memory.py keeps the same headroom for a request)
USABLE_FRACTION = 0.9
#: attention computed block by block under ring attention runs at this fraction of one whole kernel's speed (smaller
#: blocks, a float32 log-sum-exp merge per block); an assumption, see docs/parallel.md
RING_ATTENTION_EFFICIENCY = 0.8


@dataclass(frozen=True)
class ModelFigures:
    """A checkpoint as the cost model sees it. `transformer_params`: parameters of one denoising transformer;
    `block_params`: of its largest block (what a sharded rank gathers at once); `experts`: transformers held (2 for
    Wan2.2 A14B, which run one at a time); `text_encoder_bytes` (sharded under "all"), `other_bytes` (VAE, image
    encoder: never sharded); `text_tokens`: the keys of cross-attention (or the text part of joint attention)."""

    heads: int
    layers: int
    hidden: int
    transformer_params: int
    block_params: int
    experts: int = 1
    text_encoder_bytes: int = 0
    other_bytes: int = 0
    dtype_bytes: int = 2
    text_tokens: int = 512
    weight_bytes: float = 0  # bytes a transformer parameter is held in (--quantize: 1); 0: dtype_bytes


@dataclass(frozen=True)
class RequestFigures:
    """One request: `tokens` the video tokens of a transformer forward; `guided` guidance_scale > 1 (two branches);
    `latent_bytes` the noise prediction (all-gathered per step under CFG parallelism, per forward under sp); the
    memory of one rank holding everything: `activation_bytes` (the transformer's working set), `decode_bytes` (the
    VAE decode's for a whole frame), `video_bytes` (the decoded video, output rank only); `max_bands` the decode
    bands the latent rows allow."""

    tokens: int
    guided: bool
    latent_bytes: int
    activation_bytes: int
    decode_bytes: int
    video_bytes: int
    max_bands: int = 1


@dataclass(frozen=True)
class Hardware:
    """One rank's device and links (parallel/planner.py `device_figures` has the defaults, each an assumption):
    `flops` achieved matmul FLOP/s; `memory_bytes` per rank; bandwidths in bytes/s that one rank moves inside a node
    and across nodes; `latency` seconds per collective or ring pass; `layer_overhead` seconds per transformer layer
    and forward that do not scale with FLOPs (launches, Python, norms); `block_overhead` seconds per extra attention
    block under ring attention (one more kernel call and a float32 log-sum-exp merge). `collectives`: measured
    (group size, latency, bandwidth) of groups inside a node (parallel/probe.py), which take the place of `latency`
    and `intra_bandwidth` for a group of that size (the nearest measured one); `source`: "assumed" or "probed"."""

    kind: str
    flops: float
    memory_bytes: int
    intra_bandwidth: float
    inter_bandwidth: float
    latency: float
    layer_overhead: float
    block_overhead: float
    ranks_per_node: int
    collectives: tuple[tuple[int, float, float], ...] = ()
    source: str = "assumed"


@dataclass(frozen=True, order=True)
class Shape:
    """One layout: world = replicas x cfg x ulysses x ring; `shard` what FSDP2 shards over a replica's ranks."""

    replicas: int
    cfg: int
    ulysses: int
    ring: int
    shard: str = "none"

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def replica_size(self) -> int:
        return self.cfg * self.sp

    def describe(self) -> str:
        text = f"cfg {self.cfg} x ulysses {self.ulysses} x ring {self.ring}"
        if self.replicas > 1:
            text = f"replicas {self.replicas} x {text}"
        return text + (f", shard {self.shard}" if self.shard != "none" else "")


@dataclass(frozen=True)
class Candidate:
    """A layout with its estimates: `time` seconds per denoising step of one request (`parts`: its terms);
    `memory` bytes on the busiest rank (the output rank); `why` what rules it out, empty when it can run."""

    shape: Shape
    time: float
    memory: int
    fits: bool
    allowed: bool
    parts: dict[str, float] = field(default_factory=dict)
    why: str = ""

    @property
    def feasible(self) -> bool:
        return self.fits and self.allowed

    @property
    def requests_per_second(self) -> float:
        """With every replica busy: one request per replica per step time (the step count cancels out)."""
        return self.shape.replicas / self.time


@dataclass(frozen=True)
class Plan:
    chosen: Candidate
    candidates: list[Candidate]  # feasible first, then by time
    reasons: list[str]
    objective: str = "latency"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def spans_nodes(world: int, stride: int, size: int, ranks_per_node: int) -> bool:
    """Whether a group of `size` ranks `stride` apart (in blocks of size x stride, as the layout's rank order makes
    the ulysses, ring, cfg and replica groups) reaches over more than one node."""
    if size <= 1:
        return False
    for block in range(0, world, stride * size):
        for offset in range(stride):
            first, last = block + offset, block + offset + (size - 1) * stride
            if first // ranks_per_node != last // ranks_per_node:
                return True
    return False


def _measured(size: int, hw: Hardware) -> tuple[int, float, float] | None:
    return min(hw.collectives, key=lambda c: (abs(c[0] - size), c[0]), default=None)


def _latency(size: int, hw: Hardware) -> float:
    """Seconds of one collective (or ring pass) in a group of `size` ranks."""
    measured = _measured(size, hw)
    return measured[1] if measured is not None else hw.latency


def _bandwidth(world: int, stride: int, size: int, hw: Hardware) -> float:
    if spans_nodes(world, stride, size, hw.ranks_per_node):
        return hw.inter_bandwidth
    measured = _measured(size, hw)
    return measured[2] if measured is not None else hw.intra_bandwidth


def forward_compute(model: ModelFigures, request: RequestFigures, hw: Hardware, shape: Shape) -> float:
    """Seconds of one transformer forward on one rank: 2 x parameters x its tokens (the matmuls), self-attention over
    every video token and cross-attention over the text (4 x tokens x keys x width per layer; slower by
    RING_ATTENTION_EFFICIENCY under ring attention), and a fixed cost per layer."""
    local = math.ceil(request.tokens / shape.sp)  # padded to a multiple of sp
    attention = 4 * model.layers * local * (request.tokens + model.text_tokens) * model.hidden
    efficiency = RING_ATTENTION_EFFICIENCY if shape.ring > 1 else 1.0
    matmuls = 2 * model.transformer_params * local
    return (matmuls + attention / efficiency) / hw.flops + model.layers * hw.layer_overhead


def step_time(model: ModelFigures, request: RequestFigures, hw: Hardware, world: int, shape: Shape) -> dict[str, float]:
    """The terms of one denoising step of one request on a replica (seconds; the step is their sum)."""
    u, r, sp, cfg = shape.ulysses, shape.ring, shape.sp, shape.cfg
    layers, b = model.layers, model.dtype_bytes
    local = math.ceil(request.tokens / sp)
    forwards = max(1, (2 if request.guided else 1) // cfg)  # per rank and step: both branches, or its own
    compute = forward_compute(model, request, hw, shape)
    parts = {"compute": forwards * compute}
    if u > 1:  # two all-to-alls per layer (q, k, v together; the output); (u-1)/u of the data leaves the rank
        moved = 4 * local * model.hidden * b * (u - 1) / u
        parts["ulysses"] = forwards * layers * (2 * _latency(u, hw) + moved / _bandwidth(world, 1, u, hw))
    if r > 1:  # r-1 key/value passes per layer, each hidden behind one block of attention as far as that lasts, and
        # r-1 more blocks to compute and merge
        one_pass = _latency(r, hw) + 2 * local * model.hidden * b / _bandwidth(world, u, r, hw)
        block = 4 * local * request.tokens * model.hidden / r / RING_ATTENTION_EFFICIENCY / hw.flops
        parts["ring"] = forwards * layers * (r - 1) * (max(0.0, one_pass - block) + hw.block_overhead)
    if sp > 1:  # the output all-gather of every forward
        parts["gather"] = forwards * (_latency(sp, hw) + request.latent_bytes / _bandwidth(world, 1, sp, hw))
    if cfg > 1:  # one all-gather of the noise prediction per step over the CFG pair (sp ranks apart)
        parts["cfg"] = _latency(cfg, hw) + request.latent_bytes / _bandwidth(world, sp, cfg, hw)
    size = shape.replica_size
    if shape.shard != "none" and size > 1:  # every block all-gathered per forward, prefetched behind the one before
        moved = model.transformer_params * b * (size - 1) / size
        gather = layers * _latency(size, hw) + moved / _bandwidth(world, 1, size, hw)
        parts["shard"] = forwards * max(0.0, gather - compute)
    return parts


def memory_per_rank(model: ModelFigures, request: RequestFigures, shape: Shape) -> int:
    """Bytes on the output rank: the weights (of what is sharded, a 1/n share over the replica's n ranks, plus the
    two blocks and the layers outside the blocks that a sharded rank holds at once) and the larger of the
    transformer's working set (1/sp of the tokens) and the decode's (one band) with the video."""
    n, b = shape.replica_size, model.dtype_bytes
    held = model.weight_bytes or b
    transformer, text, gathered = (
        math.ceil(model.transformer_params * held) * model.experts,
        model.text_encoder_bytes,
        0,
    )
    if shape.shard != "none" and n > 1:
        outside = max(0, model.transformer_params - model.layers * model.block_params)
        gathered = (2 * model.block_params + outside) * b
        transformer = math.ceil(transformer / n)
        text = math.ceil(text / n) if shape.shard == "all" else text
    bands = max(1, min(n, request.max_bands))
    working = max(
        math.ceil(request.activation_bytes / shape.sp) + gathered,
        math.ceil(request.decode_bytes / bands) + request.video_bytes,
    )
    return transformer + text + model.other_bytes + working


def shapes(world: int, heads: int, *, can_shard: bool = True) -> list[Shape]:
    """Every layout of `world` ranks: Ulysses takes a divisor of the heads that divides sp, ring the rest."""
    found = []
    for replicas in _divisors(world):
        for cfg in (2, 1):
            if (world // replicas) % cfg:
                continue
            sp = world // replicas // cfg
            for u in sorted((d for d in _divisors(sp) if heads % d == 0), reverse=True):
                for shard in SHARD_LEVELS if can_shard and cfg * sp > 1 else ("none",):
                    found.append(Shape(replicas, cfg, u, sp // u, shard))
    return found


def estimate(model: ModelFigures, request: RequestFigures, hw: Hardware, world: int, shape: Shape) -> Candidate:
    parts = step_time(model, request, hw, world, shape)
    memory = memory_per_rank(model, request, shape)
    fits = memory <= hw.memory_bytes * USABLE_FRACTION
    allowed = shape.cfg == 1 or request.guided
    why = "" if allowed else "no guidance: the second CFG half would repeat the conditional branch"
    if not fits:
        why = f"needs {gib(memory)} per rank, over {USABLE_FRACTION:.0%} of {gib(hw.memory_bytes)}"
    return Candidate(shape, sum(parts.values()), memory, fits, allowed, parts, why)


def candidates(
    model: ModelFigures, request: RequestFigures, hw: Hardware, world: int, *, can_shard: bool = True
) -> list[Candidate]:
    """Every layout of `world` ranks with its estimates, feasible first, then by time."""
    found = [estimate(model, request, hw, world, s) for s in shapes(world, model.heads, can_shard=can_shard)]
    return sorted(found, key=lambda c: (not c.feasible, c.time, SHARD_LEVELS.index(c.shape.shard), c.shape))


def _per_request(objective: str) -> Callable[[Candidate], float]:
    """What the objective minimises: a request's step time (latency), or the step time per replica (throughput)."""
    if objective == "throughput":
        return lambda c: c.time / c.shape.replicas
    return lambda c: c.time


def choose(found: list[Candidate], hw: Hardware, world: int, objective: str = "latency") -> Plan:
    """The layout to run, and why (see docs/parallel.md, "Automatic layout", for the rules in order)."""
    score = _per_request(objective)
    pool = [c for c in found if c.feasible]
    if not pool:
        allowed = [c for c in found if c.allowed and c.shape.replicas == 1] or found
        chosen = min(allowed, key=lambda c: (c.memory, c.time))
        reasons = [f"no layout fits {gib(hw.memory_bytes)} per rank; the one that needs the least memory: {chosen.why}"]
        return Plan(chosen, found, reasons, objective)
    reasons = []
    if objective == "latency":
        pool = [c for c in pool if c.shape.replicas == 1]
        reasons.append(
            "objective latency: one request runs on every rank (replicas 1); replicas run separate requests, which "
            "helps batches and services only (--objective throughput)"
        )
    level = min(SHARD_LEVELS.index(c.shape.shard) for c in pool)
    pool = [c for c in pool if SHARD_LEVELS.index(c.shape.shard) == level]
    smallest = min(pool, key=lambda c: c.memory)
    if level == 0:
        reasons.append(f"weights unsharded: {gib(smallest.memory)} per rank fits {gib(hw.memory_bytes)}")
    else:
        reasons.append(
            f"unsharded weights do not fit {gib(hw.memory_bytes)} per rank: shard {SHARD_LEVELS[level]}, the least "
            f"sharding that fits ({gib(smallest.memory)})"
        )
    best = min(score(c) for c in pool)
    near = [c for c in pool if score(c) <= best * (1 + NEAR)]
    chosen = min(near, key=lambda c: _preference(c, world, hw, score))
    reasons += _why_this_shape(chosen, near, found, best, world, hw)
    if objective == "latency":
        reasons += _fewer_ranks_faster(chosen, found)
    return Plan(chosen, found, reasons, objective)


def _fewer_ranks_faster(chosen: Candidate, found: list[Candidate]) -> list[str]:
    """Under the latency objective: when one request would run faster on a replica's fewer ranks than on all of them
    (a model too small for the world's collectives), say so, with what would use the ranks better."""
    faster = [c for c in found if c.feasible and c.shape.replicas > 1 and c.time * (1 + NEAR) < chosen.time]
    if not faster:
        return []
    best = min(faster, key=lambda c: (c.time, c.shape.replicas))
    size = best.shape.replica_size
    return [
        f"one request would run faster on {size} ranks ({best.shape.describe()}: est. {seconds(best.time)} per step "
        f"against {seconds(chosen.time)} on all {chosen.shape.replica_size}): the collectives of the larger layout "
        f"cost more than they save for this model and request. Run {size} ranks (--num-gpus {size}) for one request "
        "at a time, or replicas for many (--objective throughput; batches and services)"
    ]


def _preference(c: Candidate, world: int, hw: Hardware, score: Callable[[Candidate], float]) -> tuple[Any, ...]:
    """Among near-equal estimates: fewer replicas, less sharding, Ulysses within a node, more Ulysses (less ring),
    CFG on."""
    s = c.shape
    within = spans_nodes(world, 1, s.ulysses, hw.ranks_per_node)
    return (s.replicas, SHARD_LEVELS.index(s.shard), within, s.ring, -s.cfg, score(c))


def _why_this_shape(
    chosen: Candidate, near: list[Candidate], found: list[Candidate], best: float, world: int, hw: Hardware
) -> list[str]:
    s = chosen.shape
    reasons = []
    if s.cfg == 2:
        reasons.append("guided (two branches): CFG parallelism runs one branch per half, one all-gather per step")
    elif any(c.shape.cfg == 2 and not c.allowed for c in found):
        reasons.append("CFG parallelism off: no guidance (guidance_scale <= 1), so there is one branch")
    elif (world // s.replicas) % 2:
        reasons.append("CFG parallelism off: an odd number of ranks per replica")
    else:
        reasons.append("CFG parallelism off: slower by the estimate, or does not fit")
    if s.sp > 1:
        where = "across nodes" if spans_nodes(world, 1, s.ulysses, hw.ranks_per_node) else "within a node"
        reasons.append(
            f"sp {s.sp}: Ulysses {s.ulysses} ({where}; it must divide the heads), ring attention {s.ring}"
            + (" across nodes" if spans_nodes(world, s.ulysses, s.ring, hw.ranks_per_node) else "")
        )
    if len(near) > 1:
        reasons.append(
            f"{len(near)} layouts within {NEAR:.0%} of the fastest estimate ({seconds(best)} per step) count as "
            "equal; preferred among them: fewer replicas, Ulysses within a node, Ulysses over ring, CFG parallelism"
        )
    return reasons


def plan_layout(
    model: ModelFigures,
    request: RequestFigures,
    hw: Hardware,
    world: int,
    *,
    objective: str = "latency",
    can_shard: bool = True,
) -> Plan:
    """Every candidate layout of `world` ranks with its estimates, and the one chosen for `objective`."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: choose one of {', '.join(OBJECTIVES)}")
    return choose(candidates(model, request, hw, world, can_shard=can_shard), hw, world, objective)
