"""Applied plans are named on their module (models/plans.py): listed in order, removed by name (the last one only),
a name applied once, and a failed apply rolled back completely; the worker lists them through collective_rpc."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from distvideo import VideoGenerator
from distvideo.families.wan.t2v import WanT2VPipeline
from distvideo.families.wan.text_padding import TextPaddingPlan, TextProjectionMemo
from distvideo.models.plans import (
    CpuKernelsPlan,
    PlanRegistry,
    applied_plans,
    apply_plan,
    apply_plans,
    get_plan,
    remove_plan,
)
from distvideo.parallel.ulysses import UlyssesPlan


def _components(tiny_model) -> dict[str, nn.Module]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    return {
        "transformer": WanTransformer3DModel.from_pretrained(tiny_model / "transformer").eval(),
        "vae": AutoencoderKLWan.from_pretrained(tiny_model / "vae").eval(),
    }


def _state(module: nn.Module) -> list[tuple[str, object]]:
    """Everything a plan may change on a module tree: hooks, replaced forwards and conv kernels, processors."""
    out: list[tuple[str, object]] = []
    for name, m in module.named_modules():
        hooks = (len(m._forward_pre_hooks), len(m._forward_hooks))
        patched = sorted(k for k in ("forward", "_conv_forward") if k in vars(m))
        out.append((name, (hooks, patched, id(getattr(m, "processor", None)))))
    return out


def _forward(transformer: nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, transformer.config.in_channels, 2, 4, 4, generator=gen)
    text = torch.zeros(1, 16, transformer.config.text_dim)
    text[:, :3] = torch.randn(1, 3, transformer.config.text_dim, generator=gen)
    with torch.no_grad():
        out = transformer(
            hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False
        )
    return out[0]


@pytest.fixture
def components(tiny_model) -> dict[str, nn.Module]:
    return _components(tiny_model)


def _speed_plans() -> list:
    counts: Counter[str] = Counter()
    return [TextPaddingPlan(counts), TextProjectionMemo(counts), CpuKernelsPlan("transformer")]


def test_plans_are_listed_in_order_and_found_by_name(components):
    transformer = components["transformer"]
    plans = _speed_plans()
    for plan in plans:
        apply_plan(transformer, plan)
    try:
        assert applied_plans(transformer) == ["text-padding", "text-projection-memo", "cpu-kernels"]
        assert [get_plan(transformer, p.name) for p in plans] == plans
        assert get_plan(transformer, "ulysses") is None
        assert applied_plans(components["vae"]) == []
        assert "PlanRegistry(WanTransformer3DModel: ['text-padding'" in repr(PlanRegistry.of(transformer))
        assert "_distvideo_plans" not in "".join(transformer.state_dict())
    finally:
        for name in reversed(applied_plans(transformer)):
            remove_plan(transformer, name)


def test_removing_by_name_undoes_that_plan_only(components):
    transformer = components["transformer"]
    loaded, reference = _state(transformer), _forward(transformer)
    apply_plan(transformer, TextPaddingPlan())
    padded = _state(transformer)
    apply_plan(transformer, CpuKernelsPlan("transformer"))
    assert _state(transformer) != padded
    remove_plan(transformer, "cpu-kernels")
    assert applied_plans(transformer) == ["text-padding"]
    assert _state(transformer) == padded  # the CPU kernels gone, the text padding still there
    remove_plan(transformer, "text-padding")
    assert applied_plans(transformer) == []
    assert _state(transformer) == loaded
    assert torch.equal(_forward(transformer), reference)


def test_a_plan_under_another_is_not_removed(components):
    """Out of order is refused: an undo restores what its plan found, so it must run with the later plans gone."""
    transformer = components["transformer"]
    for plan in _speed_plans():
        apply_plan(transformer, plan)
    applied = _state(transformer)
    with pytest.raises(ValueError, match=r"'text-padding' .* \['text-projection-memo', 'cpu-kernels'\] applied after"):
        remove_plan(transformer, "text-padding")
    assert applied_plans(transformer) == ["text-padding", "text-projection-memo", "cpu-kernels"]
    assert _state(transformer) == applied  # nothing was undone
    with pytest.raises(ValueError, match="no plan 'ulysses' is applied to WanTransformer3DModel"):
        remove_plan(transformer, "ulysses")
    with pytest.raises(ValueError, match="it has no plans"):
        remove_plan(components["vae"], "cpu-kernels")
    for name in ["cpu-kernels", "text-projection-memo", "text-padding"]:
        remove_plan(transformer, name)


def test_a_name_is_applied_once(components):
    transformer = components["transformer"]
    first = TextPaddingPlan()
    apply_plan(transformer, first)
    applied = _state(transformer)
    second = TextPaddingPlan()
    with pytest.raises(ValueError, match=r"'text-padding' is already applied to transformer .*remove it first"):
        apply_plan(transformer, second)
    assert not second.applied  # refused before its apply ran
    assert _state(transformer) == applied and get_plan(transformer, "text-padding") is first
    remove_plan(transformer, "text-padding")


def _wan_ulysses(size: int) -> UlyssesPlan:
    """A Ulysses plan over `size` ranks (no group: it never runs) at Wan's declared hook points."""
    plan = UlyssesPlan(None, size, 0)
    plan.points = WanT2VPipeline.parallel_points.sequence
    return plan


@pytest.mark.parametrize(
    "failing",
    [
        _wan_ulysses(3),  # 3 does not divide the tiny model's 4 heads: refused inside apply
        TextPaddingPlan(),  # the same name twice in one list: refused by the registry
    ],
    ids=["apply-raises", "duplicate-name"],
)
def test_a_failed_apply_rolls_back_every_plan(components, failing):
    loaded = {name: _state(module) for name, module in components.items()}
    reference = _forward(components["transformer"])
    plans = [*_speed_plans(), CpuKernelsPlan("vae"), failing]
    with pytest.raises(ValueError):
        apply_plans(components, plans)
    assert {name: applied_plans(module) for name, module in components.items()} == {"transformer": [], "vae": []}
    assert {name: _state(module) for name, module in components.items()} == loaded
    assert torch.equal(_forward(components["transformer"]), reference)


def test_apply_plans_returns_the_names_and_their_undo(components):
    loaded = {name: _state(module) for name, module in components.items()}
    applied = apply_plans(components, [*_speed_plans(), CpuKernelsPlan("vae")])
    assert applied.names() == {
        "transformer": ["text-padding", "text-projection-memo", "cpu-kernels"],
        "vae": ["cpu-kernels"],
    }
    remove_plan(components["vae"], "cpu-kernels")  # removed by name first: the undo skips it
    assert applied.names() == {"transformer": ["text-padding", "text-projection-memo", "cpu-kernels"]}
    apply_plan(components["transformer"], _wan_ulysses(2))  # a later plan on top of them
    applied()  # removes it too: it cannot stay without the plans under it
    assert applied.names() == {}
    assert {name: _state(module) for name, module in components.items()} == loaded


def _remove_the_last_two(worker) -> list[Any]:
    """The step-cache hooks removed (every block's forward its class's again), then the CPU kernels."""
    transformer = worker.pipeline.transformer
    remove_plan(transformer, "step-cache")
    hooked = [index for index, block in enumerate(transformer.blocks) if "forward" in vars(block)]
    without_cache = worker.applied_plans()
    remove_plan(transformer, "cpu-kernels")
    return [hooked, without_cache, worker.applied_plans()]


def test_the_worker_lists_its_plans_inline(tiny_model):
    with VideoGenerator.from_pretrained(tiny_model, executor="inline") as gen:
        assert gen.collective_rpc("applied_plans") == [
            {"transformer": ["text-padding", "cpu-kernels", "step-cache"], "vae": ["cpu-kernels"]}
        ]
        assert gen.collective_rpc(_remove_the_last_two) == [
            [
                [],
                {"transformer": ["text-padding", "cpu-kernels"], "vae": ["cpu-kernels"]},
                {"transformer": ["text-padding"], "vae": ["cpu-kernels"]},
            ]
        ]


@pytest.mark.slow
def test_the_workers_list_their_plans_under_sequence_parallelism(tiny_model):
    with VideoGenerator.from_pretrained(tiny_model, executor="mp", num_gpus=2, sp_size=2, cfg_parallel=False) as gen:
        every_rank = {
            "transformer": ["ulysses", "text-projection-memo", "text-padding", "cpu-kernels", "step-cache"],
            "vae": ["vae-band-decode", "cpu-kernels"],
        }
        assert gen.collective_rpc("applied_plans") == [every_rank, every_rank]
