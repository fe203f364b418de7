"""`--shard-weights` (parallel/shard.py): FSDP2 over the ranks of a replica. Each rank holds a 1/N share of the
sharded components' weights between steps, and the frames are the unsharded run's, bit for bit (the gathered weights
are the unsharded ones). What it does not combine with yet is refused before anything loads."""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest

from distvideo import VideoGenerator
from distvideo.cli.main import main
from distvideo.errors import ConfigError

pytestmark = pytest.mark.slow

cloudpickle.register_pickle_by_value(sys.modules[__name__])

REQUEST = dict(num_frames=9, height=48, width=80, num_inference_steps=3, guidance_scale=5.0, seed=4, save_video=False)


def resident(worker):
    """{component: the number of parameter values this rank holds} (a DTensor's local shard)."""
    out = {}
    for name in ("transformer", "text_encoder"):
        module = worker.pipeline.components.get(name) if hasattr(worker.pipeline, "components") else None
        module = module if module is not None else getattr(worker.pipeline, name, None)
        if module is not None:
            out[name] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters())
    return out


def gathered(worker):
    """What the memory estimate adds under sharding, and the transformer's whole parameters, in bytes."""
    whole = sum(p.numel() * p.element_size() for p in worker.pipeline.transformer.parameters())  # a DTensor's: global
    return worker._gathered_bytes, whole


def run(checkpoint, layout, shard):
    with VideoGenerator.from_pretrained(str(checkpoint), executor="mp", shard_weights=shard, **layout) as gen:
        frames = gen.generate("a lighthouse in a storm", **REQUEST).frames
        plans = gen.collective_rpc("applied_plans")
        return frames, gen.collective_rpc(resident), plans, gen.collective_rpc(gathered)


@pytest.mark.parametrize(
    ("layout", "shard", "sharded"),
    [
        (dict(num_gpus=2, cfg_parallel=False, sp_size=2), "transformer", ("transformer",)),
        (dict(num_gpus=4, cfg_parallel=True, sp_size=2), "all", ("transformer", "text_encoder")),
    ],
    ids=["sp2-transformer", "cfg2xsp2-all"],
)
def test_sharded_weights_give_the_unsharded_frames_with_a_share_of_the_weights_per_rank(
    test_checkpoint, layout, shard, sharded
):
    whole, whole_resident, _, unsharded = run(test_checkpoint, layout, "none")
    frames, shares, plans, estimate = run(test_checkpoint, layout, shard)
    assert frames.dtype == np.uint8 and np.array_equal(frames, whole), "sharding changed the frames"
    ranks = layout["num_gpus"]
    for name in sharded:
        full = whole_resident[0][name]
        assert sum(share[name] for share in shares) == full, (name, shares, full)  # every value held once
        assert all(share[name] <= full / ranks * 1.1 for share in shares), (name, shares, full)
        assert all("shard-weights" in rank_plans[name] for rank_plans in plans), plans
    # the memory check adds the full parameters held while the transformer runs: two blocks and the rest
    assert all(extra == 0 for extra, _ in unsharded), unsharded
    assert all(0 < extra <= whole for extra, whole in estimate), estimate
    for name in {"transformer", "text_encoder"} - set(sharded):
        assert all(share[name] == whole_resident[0][name] for share in shares)


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        (dict(compile=True), "compile"),
        (dict(offload="text"), "offload"),
        (dict(lora=["style.safetensors"]), "lora"),
    ],
)
def test_what_sharding_does_not_combine_with_is_refused_before_loading(test_checkpoint, kwargs, what):
    from distvideo.config import EngineConfig, LoraSpec

    if "lora" in kwargs:
        kwargs = {"lora": [LoraSpec(path=kwargs["lora"][0])]}
    config = EngineConfig(model=str(test_checkpoint), num_gpus=2, shard_weights="transformer", **kwargs)
    with pytest.raises(ConfigError, match=f"shard_weights='transformer' with {what}"):
        config.validate()


def test_an_unknown_shard_mode_exits_2_naming_the_flag(capsys):
    assert main(["generate", "--prompt", "x", "--shard-weights", "half"]) == 2
    assert "--shard-weights" in capsys.readouterr().err


def test_an_adapter_on_sharded_weights_is_refused_and_nothing_changes(test_checkpoint, tmp_path):
    from distvideo.errors import LoraError
    from distvideo.testing.lora_files import build_random_lora

    style = build_random_lora(test_checkpoint, tmp_path / "style.safetensors", seed=3)
    layout = dict(num_gpus=2, cfg_parallel=False, sp_size=2)
    with VideoGenerator.from_pretrained(
        str(test_checkpoint), executor="mp", shard_weights="transformer", **layout
    ) as gen:
        before = gen.generate("a lighthouse in a storm", **REQUEST).frames
        with pytest.raises(LoraError, match="shard_weights='transformer'"):
            gen.set_lora_adapter("style", str(style), 1.0)
        assert np.array_equal(gen.generate("a lighthouse in a storm", **REQUEST).frames, before)
