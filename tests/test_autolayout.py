"""The automatic layout's cost model (parallel/autolayout.py) as tables on plain numbers, one rule each; the test
checkpoints keep the layout they had before it (the suite's launched tests run with no layout option); the engine
takes it only when no layout option is given."""

from __future__ import annotations

import dataclasses

import pytest

from distvideo.config import EngineConfig
from distvideo.errors import ConfigError
from distvideo.executors import resolve_engine
from distvideo.models.registry import probe_model
from distvideo.parallel import planner
from distvideo.parallel.autolayout import (
    NEAR,
    Hardware,
    ModelFigures,
    RequestFigures,
    Shape,
    memory_per_rank,
    plan_layout,
    shapes,
    spans_nodes,
    step_time,
)
from distvideo.parallel.layout import resolve_layout

GIB = 2**30
# Wan2.1 14B-shaped (40 heads x 128, 40 layers, 14 B parameters, UMT5-XXL) at 720p, 81 frames, bf16
WAN14B = ModelFigures(
    heads=40,
    layers=40,
    hidden=5120,
    transformer_params=14_000_000_000,
    block_params=340_000_000,
    text_encoder_bytes=11 * GIB,
    other_bytes=GIB // 2,
    dtype_bytes=2,
)
WAN14B_720P = RequestFigures(
    tokens=75600,
    guided=True,
    latent_bytes=16 * 21 * 90 * 160 * 4,
    activation_bytes=75600 * (10 * 5120 + 2 * 13824) * 2,
    decode_bytes=250 * 96 * 720 * 1280,
    video_bytes=24 * 81 * 720 * 1280,
    max_bands=45,
)
H100 = Hardware(
    "cuda",
    400e12,
    80 * GIB,
    intra_bandwidth=150e9,
    inter_bandwidth=25e9,
    latency=20e-6,
    layer_overhead=50e-6,
    block_overhead=20e-6,
    ranks_per_node=8,
)
# the suite's tiny checkpoint (tiny-wan: 4 heads x 8, 2 layers) at its default request, on a 2-core CPU
TINY = ModelFigures(
    heads=4,
    layers=2,
    hidden=32,
    transformer_params=48032,
    block_params=13024,
    text_encoder_bytes=132224,
    other_bytes=974332,
    dtype_bytes=4,
)
TINY_REQUEST = RequestFigures(
    tokens=80,
    guided=True,
    latent_bytes=20480,
    activation_bytes=143360,
    decode_bytes=4096000,
    video_bytes=1671168,
    max_bands=4,
)
CPU = Hardware(
    "cpu",
    100e9,
    8 * GIB,
    intra_bandwidth=1e9,
    inter_bandwidth=1e9,
    latency=200e-6,
    layer_overhead=1e-3,
    block_overhead=250e-6,
    ranks_per_node=8,
)


def chosen(model=WAN14B, request=WAN14B_720P, hw=H100, world=8, **kwargs) -> tuple:
    s = plan_layout(model, request, hw, world, **kwargs).chosen.shape
    return (s.replicas, s.cfg, s.ulysses, s.ring, s.shard)


# --- the rules, one table each -----------------------------------------------------------------------------------


# (world, heads) -> the (cfg, ulysses, ring) of one replica: Ulysses only divides the heads, ring takes the rest
SHAPES = [
    (4, 4, {(2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)}),
    (4, 3, {(2, 1, 2), (1, 1, 4)}),
    (6, 4, {(2, 1, 3), (1, 2, 3), (1, 1, 6)}),
    (3, 12, {(1, 3, 1), (1, 1, 3)}),
]


@pytest.mark.parametrize(("world", "heads", "expected"), SHAPES)
def test_ulysses_divides_the_heads_and_ring_takes_the_rest(world, heads, expected):
    found = {(s.cfg, s.ulysses, s.ring) for s in shapes(world, heads) if s.replicas == 1}
    assert found == expected
    assert all(s.replicas * s.cfg * s.sp == world for s in shapes(world, heads))


def test_cfg_parallelism_needs_guidance():
    assert chosen(world=8)[1] == 2
    unguided = dataclasses.replace(WAN14B_720P, guided=False)
    assert chosen(request=unguided, world=8)[:4] == (1, 1, 8, 1)
    plan = plan_layout(WAN14B, unguided, H100, 8)
    refused = [c for c in plan.candidates if c.shape.cfg == 2]
    assert refused and all(not c.feasible and "no guidance" in c.why for c in refused)
    assert any("no guidance" in r for r in plan.reasons)


# memory per rank (GiB) -> the sharding chosen: none while it fits, then the least that fits
SHARDING = [(80, "none"), (40, "transformer"), (16, "all")]


@pytest.mark.parametrize(("memory", "shard"), SHARDING)
def test_sharding_only_when_unsharded_does_not_fit(memory, shard):
    hw = dataclasses.replace(H100, memory_bytes=memory * GIB)
    assert chosen(hw=hw)[4] == shard
    assert chosen(hw=hw)[:4] == (1, 2, 8 // 2, 1)  # the layout itself stays


def test_an_unsharded_layout_that_fits_wins_over_a_faster_sharded_one():
    """44 GiB on nodes of 4: cfg 2 x ulysses 4 fits only sharded, cfg 1 x sp 8 (half the activations per rank)
    unsharded, with ring attention across the nodes (slower by more than NEAR)."""
    request = dataclasses.replace(WAN14B_720P, decode_bytes=0, video_bytes=0)
    hw = dataclasses.replace(H100, memory_bytes=44 * GIB, ranks_per_node=4)
    plan = plan_layout(WAN14B, request, hw, 8)
    assert (plan.chosen.shape.cfg, plan.chosen.shape.ulysses, plan.chosen.shape.shard) == (1, 4, "none")
    fastest = plan.candidates[0]
    assert fastest.feasible and fastest.shape.shard != "none" and fastest.time * (1 + NEAR) < plan.chosen.time


def test_nothing_fits_is_said_and_the_smallest_is_chosen():
    plan = plan_layout(WAN14B, WAN14B_720P, dataclasses.replace(H100, memory_bytes=4 * GIB), 8)
    assert not plan.chosen.feasible and plan.chosen.shape.shard == "all"
    assert plan.reasons[0].startswith("no layout fits")
    assert plan.chosen.memory == min(c.memory for c in plan.candidates if c.shape.replicas == 1 and c.allowed)


def test_memory_per_rank_divides_what_is_split():
    request = dataclasses.replace(WAN14B_720P, decode_bytes=0, video_bytes=0)  # the transformer's stage dominates

    def memory(*shape):
        return memory_per_rank(WAN14B, request, Shape(*shape))

    weights, activations = WAN14B.transformer_params * 2, request.activation_bytes
    gathered = (2 * WAN14B.block_params + 400_000_000) * 2  # two blocks and what lies outside the 40 blocks
    assert memory(1, 1, 1, 1) - memory(1, 1, 8, 1) == activations * 7 // 8
    assert memory(1, 1, 8, 1) - memory(1, 1, 8, 1, "transformer") == weights * 7 // 8 - gathered
    assert memory(1, 1, 8, 1, "transformer") - memory(1, 1, 8, 1, "all") == WAN14B.text_encoder_bytes * 7 // 8
    # the weights are shared over the whole replica, CFG halves included
    assert memory(1, 2, 4, 1) - memory(1, 2, 4, 1, "transformer") == weights * 7 // 8 - gathered


def test_quantized_weights_count_one_byte_per_parameter():
    """--quantize holds a transformer parameter in one byte (int8 or float8): the plan's weights are half bfloat16's."""
    request = dataclasses.replace(WAN14B_720P, decode_bytes=0, video_bytes=0)
    quantized = dataclasses.replace(WAN14B, weight_bytes=1)
    shape = Shape(1, 1, 8, 1)
    assert memory_per_rank(WAN14B, request, shape) - memory_per_rank(quantized, request, shape) == (
        WAN14B.transformer_params * WAN14B.experts
    )


# (world, ranks per node, heads) -> (replicas, cfg, ulysses, ring): Ulysses inside a node, ring and CFG across
NODES = [
    (8, 8, 40, (1, 2, 4, 1)),
    (16, 8, 40, (1, 2, 8, 1)),  # sp 8 fills a node, the CFG pair spans two
    (32, 8, 40, (1, 2, 8, 2)),  # ring across nodes
    (16, 8, 12, (1, 2, 4, 2)),  # 12 heads: Ulysses 4, ring 2 inside the node
    (8, 2, 40, (1, 2, 2, 2)),  # nodes of 2: a Ulysses 4 would span nodes
]


@pytest.mark.parametrize(("world", "per_node", "heads", "expected"), NODES)
def test_ulysses_within_a_node_ring_across(world, per_node, heads, expected):
    model = dataclasses.replace(WAN14B, heads=heads)
    assert chosen(model=model, hw=dataclasses.replace(H100, ranks_per_node=per_node), world=world)[:4] == expected


def test_latency_keeps_one_replica_throughput_may_take_more():
    assert chosen(TINY, TINY_REQUEST, CPU, 8)[0] == 1
    plan = plan_layout(TINY, TINY_REQUEST, CPU, 8, objective="throughput")
    assert plan.chosen.shape.replicas > 1
    best = max(c.requests_per_second for c in plan.candidates if c.feasible)
    assert plan.chosen.requests_per_second >= best / 1.1


def test_step_time_has_a_term_for_each_communication():
    def terms(shape):
        return set(step_time(WAN14B, WAN14B_720P, H100, shape.replicas * shape.cfg * shape.sp, shape))

    assert terms(Shape(1, 1, 1, 1)) == {"compute"}
    assert terms(Shape(1, 2, 1, 1)) == {"compute", "cfg"}
    assert terms(Shape(1, 1, 2, 1)) == {"compute", "ulysses", "gather"}
    assert terms(Shape(1, 1, 1, 2, "transformer")) == {"compute", "ring", "gather", "shard"}
    one = step_time(WAN14B, WAN14B_720P, H100, 1, Shape(1, 1, 1, 1))["compute"]
    four = step_time(WAN14B, WAN14B_720P, H100, 4, Shape(1, 1, 4, 1))["compute"]
    assert four == pytest.approx(one / 4, rel=0.01)  # the video's tokens split; only the per-layer overhead stays


SPANS = [
    (8, 1, 4, 8, False),
    (8, 1, 4, 2, True),
    (16, 8, 2, 8, True),  # a CFG pair 8 apart
    (8, 2, 2, 4, False),  # ring ranks 2 apart inside a node of 4
    (8, 1, 1, 1, False),
]


@pytest.mark.parametrize(("world", "stride", "size", "per_node", "expected"), SPANS)
def test_spans_nodes(world, stride, size, per_node, expected):
    assert spans_nodes(world, stride, size, per_node) is expected


# --- the test checkpoints keep today's default ----------------------------------------------------------------------


@pytest.mark.parametrize("heads", [2, 3, 4, 6, 12])
@pytest.mark.parametrize("flops", [1e9, 50e9, 5e12])  # a loaded core to a large CPU node
def test_the_tiny_checkpoints_keep_the_rules_default(heads, flops):
    """The launched tests run with no layout option on 1-8 CPU ranks, on one node or two (srun -N 2): the automatic
    choice equals the old rules'."""
    model = dataclasses.replace(TINY, heads=heads)
    for world in range(1, 9):
        old = resolve_layout(world, num_heads=heads)
        for per_node in {world, 2} if world % 2 == 0 else {world}:
            hw = dataclasses.replace(CPU, flops=flops, ranks_per_node=per_node)
            got = chosen(model, TINY_REQUEST, hw, world)
            assert got == (1, old.cfg_degree, old.ulysses_size, old.ring_size, "none"), (world, per_node)


@pytest.mark.parametrize("name", ["tiny-wan", "demo-wan"])
def test_the_embedded_checkpoints_keep_the_rules_default(name):
    from distvideo.models.embedded import embedded_model_path

    model = probe_model(embedded_model_path().parent / name)
    for world in range(1, 9):
        old = resolve_layout(world, num_heads=model.num_attention_heads)
        s = planner.plan_for(model, planner.default_request(model), world, device="cpu").chosen.shape
        assert (s.replicas, s.cfg, s.ulysses, s.ring, s.shard) == (
            1,
            old.cfg_degree,
            old.ulysses_size,
            old.ring_size,
            "none",
        ), world


# --- the engine: automatic unless a layout option is given ------------------------------------------------------


def _layout(**kwargs):
    engine = resolve_engine(EngineConfig(num_gpus=4, executor="mp", device="cpu", **kwargs), environ={})
    return engine.layout, engine.config.shard_weights


# engine options -> (cfg, ulysses, ring, replicas) as the old rules resolve them
EXPLICIT = [
    (dict(sp_size=4), (1, 4, 1, 1)),
    (dict(cfg_parallel=False), (1, 4, 1, 1)),
    (dict(ring_size=2), (2, 1, 2, 1)),
    (dict(replicas=2), (2, 1, 1, 2)),
    (dict(shard_weights="none"), (2, 2, 1, 1)),
    (dict(layout="rules"), (2, 2, 1, 1)),
]


@pytest.mark.parametrize(("options", "expected"), EXPLICIT)
def test_an_explicit_layout_wins(options, expected, monkeypatch):
    # a device too small for anything unsharded: the cost model would shard; a given option keeps the old rules
    small = planner.device_figures("cpu", 4, memory_bytes=1 << 20)
    monkeypatch.setattr(planner, "device_figures", lambda *a, **k: small)
    layout, shard = _layout(**options)
    assert (layout.cfg_degree, layout.ulysses_size, layout.ring_size, layout.replicas) == expected
    assert shard == "none"


def test_the_engine_takes_the_cost_models_choice(monkeypatch):
    layout, shard = _layout()
    assert (layout.cfg_degree, layout.ulysses_size, layout.ring_size, shard) == (2, 2, 1, "none")
    model = resolve_engine(EngineConfig()).model
    plan = planner.plan_for(model, planner.default_request(model), 4, device="cpu")
    need = {c.shape.shard: c.memory for c in plan.candidates if c.shape.describe().startswith("cfg 2 x ulysses 2 x")}
    # a device that fits the layout only with the transformer sharded
    tight = planner.device_figures("cpu", 4, memory_bytes=int((need["none"] + need["transformer"]) / 2 / 0.9))
    monkeypatch.setattr(planner, "device_figures", lambda *a, **k: tight)
    layout, shard = _layout(layout="auto")
    assert (layout.cfg_degree, layout.ulysses_size, shard) == (2, 2, "transformer")
    layout, shard = _layout(compile=True)  # sharding does not combine with compile: never chosen with it
    assert shard == "none"


def test_layout_is_a_checked_option():
    with pytest.raises(ConfigError, match="layout='best' is not supported; choose one of auto, rules"):
        EngineConfig(layout="best").validate()


def test_many_requests_are_planned_for_throughput():
    """A batch or a service (objective "throughput") on 4 ranks of the demo model: two replicas of cfg 2, where one
    request alone runs fastest on cfg 2 x ulysses 2 (the test above); an explicit option still wins."""
    config = EngineConfig(num_gpus=4, executor="mp", device="cpu")
    layout = resolve_engine(config, environ={}, objective="throughput").layout
    assert (layout.replicas, layout.cfg_degree, layout.ulysses_size, layout.ring_size) == (2, 2, 1, 1)
    given = resolve_engine(dataclasses.replace(config, sp_size=2), environ={}, objective="throughput").layout
    assert (given.replicas, given.cfg_degree, given.sp_size) == (1, 2, 2)


def _objective_of(monkeypatch, owner, run) -> list[str]:
    """The objective each `owner.resolve_engine` call of `run()` asked for (the call raises: nothing loads)."""
    seen: list[str] = []

    class Stop(Exception):
        pass

    def spy(config, environ=None, *, objective="latency"):
        seen.append(objective)
        raise Stop

    monkeypatch.setattr(owner, "resolve_engine", spy)
    try:
        run()  # the CLI reports the exception and returns an exit code; serve() lets it through
    except Stop:
        pass
    return seen


def test_a_batch_and_a_service_ask_for_throughput(monkeypatch, tmp_path):
    """`generate --prompts` and `serve` plan for throughput; one `generate`, and a service with request-selectable
    adapters (one replica switches them), for latency."""
    from distvideo import executors
    from distvideo.cli.main import main
    from distvideo.serving import server
    from distvideo.serving.options import ServeOptions

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red ball\n")
    batch = ["generate", "--prompts", str(prompts), "--num-gpus", "4", "--output", str(tmp_path / "out")]
    assert _objective_of(monkeypatch, executors, lambda: main(batch)) == ["throughput"]
    one = ["generate", "--prompt", "x", "--num-gpus", "4"]
    assert _objective_of(monkeypatch, executors, lambda: main(one)) == ["latency"]
    config = EngineConfig(num_gpus=4)
    assert _objective_of(monkeypatch, server, lambda: server.serve(config, ServeOptions())) == ["throughput"]
    on_ray = dataclasses.replace(config, executor="ray")  # its replicas meet in a store every node reaches
    assert _objective_of(monkeypatch, server, lambda: server.serve(on_ray, ServeOptions())) == ["throughput"]
    adapters = ServeOptions(lora_adapters={"style": "style.safetensors"})
    assert _objective_of(monkeypatch, server, lambda: server.serve(config, adapters)) == ["latency"]
