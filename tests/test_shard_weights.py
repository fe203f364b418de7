"""`--shard-weights` (parallel/shard.py): FSDP2 over the ranks of a replica. Each rank holds a 1/N share of the
sharded components' weights between steps, and the frames are the unsharded run's, bit for bit (the gathered weights
are the unsharded ones). LoRA adapters merge into each rank's rows (lora/sharded.py `local_rows`): the same frames
and gathered weights as the unsharded layout with the same adapters. A cached request skips the same steps and gives
the unsharded cached frames, bit for bit. What it does not combine with yet is refused before anything loads."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import torch
from torch import nn

from distvideo import VideoGenerator
from distvideo.cli.main import main
from distvideo.errors import ConfigError
from distvideo.lora.sharded import shard_rows

from background import FolderJob, in_a_process
from launchers import format_output

cloudpickle.register_pickle_by_value(sys.modules[__name__])

REQUEST = dict(num_frames=9, height=48, width=80, num_inference_steps=3, guidance_scale=5.0, seed=4, save_video=False)
# step caching over FSDP-wrapped blocks: a threshold no change reaches skips every step after the first
CACHED = dict(REQUEST, num_inference_steps=5, cache="first-block", cache_threshold=1e6)


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
        cached = gen.generate("a lighthouse in a storm", **CACHED)
        plans = gen.collective_rpc("applied_plans")
        return (frames, cached.frames, cached.cache), gen.collective_rpc(resident), plans, gen.collective_rpc(gathered)


def both_runs(checkpoint, layout, shard) -> dict:
    """The layout unsharded, then with `shard`: what the test checks, in JSON's types but the frames."""
    (whole, whole_cached, whole_report), whole_resident, _, unsharded = run(checkpoint, layout, "none")
    (frames, cached, report), shares, plans, estimate = run(checkpoint, layout, shard)
    return {
        "whole": whole,
        "frames": frames,
        "whole_cached": whole_cached,
        "cached": cached,
        "cache_reports": [whole_report, report],
        "whole_resident": whole_resident,
        "unsharded": [list(pair) for pair in unsharded],
        "shares": shares,
        "plans": plans,
        "estimate": [list(pair) for pair in estimate],
    }


FOUR_RANKS = (dict(num_gpus=4, cfg_parallel=True, sp_size=2), "all")


def four_ranks_to(folder: Path) -> None:
    """FOUR_RANKS's runs (4 ranks on 2 cores, twice: about 24 s) in a process of its own (FOUR_RANKS_RUNS), on the
    session's test checkpoint built here (the same bytes): FOLDER/frames.npz and FOLDER/report.json."""
    from distvideo.testing.checkpoints import build_test_checkpoint

    runs = both_runs(build_test_checkpoint(folder / "ckpt"), *FOUR_RANKS)
    arrays = {name: runs.pop(name) for name in ("whole", "frames", "whole_cached", "cached")}
    np.savez(folder / "frames.npz", **arrays)
    (folder / "report.json").write_text(json.dumps(runs))


FOUR_RANKS_RUNS = FolderJob(
    "sharded weights on 4 mp ranks", "shard4", in_a_process("test_shard_weights", "four_ranks_to")
)
BACKGROUND_JOBS = {"sharding_runs[cfg2xsp2]": FOUR_RANKS_RUNS.hooks}


@pytest.fixture
def sharding_runs(request: pytest.FixtureRequest, layout: dict, shard: str) -> dict:
    if (layout, shard) != FOUR_RANKS:
        return both_runs(request.getfixturevalue("test_checkpoint"), layout, shard)
    folder, proc = FOUR_RANKS_RUNS.result()
    assert proc.returncode == 0, format_output(proc)
    with np.load(folder / "frames.npz") as saved:
        return {**json.loads((folder / "report.json").read_text()), **{name: saved[name] for name in saved.files}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "shard", "sharded"),
    [
        (dict(num_gpus=2, cfg_parallel=False, sp_size=2), "transformer", ("transformer",)),
        (*FOUR_RANKS, ("transformer", "text_encoder")),
    ],
    ids=["sp2-transformer", "cfg2xsp2-all"],
)
def test_sharded_weights_give_the_unsharded_frames_with_a_share_of_the_weights_per_rank(
    sharding_runs, layout, shard, sharded
):
    whole, whole_resident, unsharded = (
        sharding_runs["whole"],
        sharding_runs["whole_resident"],
        sharding_runs["unsharded"],
    )
    frames, shares, plans, estimate = (sharding_runs[k] for k in ("frames", "shares", "plans", "estimate"))
    assert frames.dtype == np.uint8 and np.array_equal(frames, whole), "sharding changed the frames"
    # step caching over the sharded blocks: the same skips and the unsharded cached frames, bit for bit
    unsharded_report, sharded_report = sharding_runs["cache_reports"]
    assert sharded_report == unsharded_report and sharded_report["skipped_steps"] == [1, 2, 3, 4], sharding_runs
    assert np.array_equal(sharding_runs["cached"], sharding_runs["whole_cached"]), "sharding changed cached frames"
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


@pytest.mark.parametrize(("kwargs", "what"), [(dict(compile=True), "compile"), (dict(offload="text"), "offload")])
def test_what_sharding_does_not_combine_with_is_refused_before_loading(test_checkpoint, kwargs, what):
    from distvideo.config import EngineConfig, LoraSpec

    config = EngineConfig(model=str(test_checkpoint), num_gpus=2, shard_weights="transformer", **kwargs)
    with pytest.raises(ConfigError, match=f"shard_weights='transformer' with {what}"):
        config.validate()
    lora = [LoraSpec(path="style.safetensors")]  # adapters combine with sharding now
    EngineConfig(model=str(test_checkpoint), num_gpus=2, shard_weights="transformer", lora=lora).validate()


def test_an_unknown_shard_mode_exits_2_naming_the_flag(capsys):
    assert main(["generate", "--prompt", "x", "--shard-weights", "half"]) == 2
    assert "--shard-weights" in capsys.readouterr().err


# --- LoRA on sharded weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "ranks"), [(32, 2), (7, 2), (7, 3), (1, 2), (2, 3), (5, 4), (0, 2), (64, 3)])
def test_shard_rows_are_the_rows_torch_chunk_gives_each_rank(rows, ranks):
    """FSDP2 splits dim 0 as torch.chunk does: chunks of ceil(rows / ranks), the last ranks' short or empty."""
    chunks = torch.arange(rows).chunk(ranks) if rows else ()
    for index in range(ranks):
        start, stop = shard_rows(rows, ranks, index)
        held = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, stop)) == held, (rows, ranks, index)


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def lora_on_uneven_shards(worker) -> int:
    """On every rank of a sharded engine: a toy model whose rows do not divide over the replica's 2 ranks (7 as 4 + 3,
    1 as 1 + 0, 5 as 3 + 2, weights and biases, inside the sharded blocks and outside them), sharded by ShardPlan over
    the engine's replica mesh, and an unsharded copy. The same LoRA steps on both: merge (low-rank, full and bias
    deltas), stack, unmerge, merge, clear; after each the gathered weights equal the copy's bit for bit, and so do
    the outputs; after clear both are the base. Returns the number of steps checked."""
    from distvideo.lora import LoraFile, LoraLayerWeights, LoraState
    from distvideo.parallel.shard import ShardPlan

    class Block(nn.Sequential):
        pass

    class Toy(nn.Module):
        _repeated_blocks = ("Block",)

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(nn.Linear(6, 7), nn.Linear(7, 6)) for _ in range(2)])
            self.gate = nn.Linear(6, 1)
            self.proj_out = nn.Linear(6, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.proj_out(x) * self.gate(x)

    gen = torch.Generator().manual_seed(11)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def lora_file(name: str, layers: dict) -> LoraFile:
        return LoraFile(path=f"{name}.safetensors", layers=layers, layout="diffusers", sha256=name, skipped=[])

    a = {
        "blocks.0.0": LoraLayerWeights(down=randn(2, 6), up=randn(7, 2), alpha=1.0),
        "blocks.1.1": LoraLayerWeights(down=randn(2, 7), up=randn(6, 2), bias=randn(6)),
        "gate": LoraLayerWeights(down=randn(2, 6), up=randn(1, 2), bias=randn(1)),
        "proj_out": LoraLayerWeights(diff=randn(5, 6), bias=randn(5)),
    }
    b = {
        "blocks.0.0": LoraLayerWeights(diff=randn(7, 6), bias=randn(7)),
        "proj_out": LoraLayerWeights(down=randn(3, 6), up=randn(5, 3), alpha=6.0),
    }
    files = {"a": lora_file("a", a), "b": lora_file("b", b)}
    torch.manual_seed(5)
    plain = Toy()
    base = {name: bits(p) for name, p in plain.named_parameters()}
    sharded = copy.deepcopy(plain)
    ShardPlan("toy", worker.parallel.groups.replica_device_mesh()).apply(sharded)
    x = randn(3, 6)
    states = [LoraState(plain), LoraState(sharded)]

    def check(step: str) -> None:
        with torch.no_grad():  # state_dict: the shards (it reshards FSDP2's root), each gathered whole
            whole = {n: t.full_tensor() for n, t in sharded.state_dict().items()}
            wrong = [n for n, p in plain.named_parameters() if bits(whole[n]) != bits(p)]
            assert not wrong, f"{step}: gathered sharded weights differ from the unsharded merge in {wrong}"
            assert bits(plain(x)) == bits(sharded(x)), f"{step}: the sharded toy's output differs"
        sharded.unshard()  # the next step finds the root's own parameters gathered, as after a forward by default

    steps = [
        ("set a", lambda s: (s.prepare("a", lambda: files["a"], 0.7, False), s.commit())),
        ("stack b", lambda s: (s.prepare("b", lambda: files["b"], -1.5, True), s.commit())),
        ("unmerge", lambda s: s.transition(s.active, merged=False)),
        ("merge", lambda s: s.transition(s.active, merged=True)),
        ("clear", lambda s: s.transition([], merged=True)),
    ]
    check("before")
    for step, change in steps:
        for state in states:
            change(state)
        check(step)
    assert {name: bits(p) for name, p in plain.named_parameters()} == base, "clear: not the base"
    return len(steps)


def plant_merge_failure(worker, victim: int) -> None:
    """On rank `victim`, the third merged-weight write of the next LoRA step raises, once (some layers changed)."""
    from distvideo.lora.rank import lora_state

    if worker.rank != victim:
        return
    state = lora_state(worker)
    method, writes = state._write_merged, []

    def write(*args, **kwargs):
        writes.append(args)
        if len(writes) == 3:
            del state._write_merged
            raise RuntimeError(f"planted failure on rank {worker.rank}")
        return method(*args, **kwargs)

    state._write_merged = write


@pytest.fixture(scope="module")
def adapters(test_checkpoint, tmp_path_factory):
    """Two adapter files. style: low-rank on every linear layer, the ones outside the blocks too (proj_out, the
    condition embedder); motion: low-rank on every layer plus a full weight delta and bias deltas, in and outside the blocks."""
    from safetensors.torch import save_file

    from distvideo.testing.lora_files import build_random_lora, lora_keys, random_lora_layers

    folder = tmp_path_factory.mktemp("shard-lora")
    style = build_random_lora(test_checkpoint, folder / "style.safetensors", seed=3, pattern=".*")
    tensors = {}
    for name, (down, up) in random_lora_layers(test_checkpoint, seed=4, pattern=".*").items():
        down_key, up_key, _ = lora_keys(name, "diffusers")
        tensors[down_key], tensors[up_key] = down.contiguous(), up.contiguous()
    gen = torch.Generator().manual_seed(6)
    tensors["transformer.blocks.1.ffn.net.0.proj.diff"] = torch.randn(64, 32, generator=gen) * 0.05
    tensors["transformer.blocks.1.ffn.net.0.proj.diff_b"] = torch.randn(64, generator=gen) * 0.05
    tensors["transformer.proj_out.diff_b"] = torch.randn(64, generator=gen) * 0.05
    motion = folder / "motion.safetensors"
    save_file(tensors, str(motion))
    return {"style": str(style), "motion": str(motion)}


def lora_session(checkpoint, shard: str, adapters: dict[str, str]) -> dict:
    """One mp engine at sp 2: set, switch, switch back and stack, a merge failing on rank 1, unmerge, clear. Frames
    after each adapter step, and every rank's digest of the whole transformer weights (gathered when sharded)."""
    from distvideo.lora.rank import describe, transformer_digest

    layout = dict(num_gpus=2, cfg_parallel=False, sp_size=2)
    seen: dict = {}
    with VideoGenerator.from_pretrained(str(checkpoint), executor="mp", shard_weights=shard, **layout) as gen:

        def record(step: str, frames: bool = True) -> None:  # the digest first: the next step follows a forward
            digests = gen.collective_rpc(transformer_digest)
            seen[step] = (gen.generate("a lighthouse in a storm", **REQUEST).frames if frames else None, digests)

        record("base", frames=False)
        gen.set_lora_adapter("style", adapters["style"], 0.8)
        record("style")
        gen.set_lora_adapter("motion", adapters["motion"], 1.0)  # after a forward: FSDP2's root stays gathered
        record("motion")
        gen.set_lora_adapter("style", strength=0.8)  # back to the cached adapter
        record("style again", frames=False)
        gen.set_lora_adapter("motion", strength=0.5, accumulate=True)
        gen.unmerge_lora_weights()
        record("unmerged")
        gen.collective_rpc(plant_merge_failure, args=(1,))
        with pytest.raises(RuntimeError, match="planted failure on rank 1"):
            gen.merge_lora_weights()
        seen["after a failed merge"] = (gen.collective_rpc(describe), gen.collective_rpc(transformer_digest))
        gen.merge_lora_weights()
        record("stacked", frames=False)
        if shard != "none":
            seen["toy"] = gen.collective_rpc(lora_on_uneven_shards)
        gen.clear_lora_adapters()
        record("cleared", frames=False)
    return seen


@pytest.mark.slow
def test_lora_on_sharded_weights_gives_the_unsharded_frames_and_weights(test_checkpoint, adapters):
    """sp 2 with shard_weights="transformer" against sp 2 unsharded, the same adapters: after set, switch, switch back
    and stack (merged) and unmerge, the frames are the same bytes and the gathered weights the same bits; a merge that
    fails on rank 1 leaves every rank unmerged over the base; clear gives the base bit for bit. And on a toy model
    whose rows do not divide over the ranks (one rank's shard empty), every step equals the unsharded one."""
    whole = lora_session(test_checkpoint, "none", adapters)
    sharded = lora_session(test_checkpoint, "transformer", adapters)
    assert sharded["toy"] == [5, 5]
    base = whole["base"][1]
    assert len(set(base)) == 1 and sharded["base"][1] == base
    for step in ("style", "motion", "style again", "unmerged", "stacked", "cleared"):
        frames, digests = sharded[step]
        assert len(set(digests)) == 1 and digests == whole[step][1], f"{step}: gathered weights differ"
        if frames is not None:
            assert frames.dtype == np.uint8 and np.array_equal(frames, whole[step][0]), f"{step}: frames differ"
    assert whole["style"][1] != base and whole["motion"][1] != whole["style"][1] != whole["stacked"][1] != base
    assert not np.array_equal(whole["style"][0], whole["motion"][0])
    assert whole["style again"][1] == whole["style"][1]
    assert whole["unmerged"][1] == whole["cleared"][1] == base
    described, digests = sharded["after a failed merge"]
    assert all(not d["merged"] and d["active"] == [["style", 0.8], ["motion", 0.5]] for d in described), described
    assert digests == base, "a merge failing on rank 1 did not roll every rank back to the unmerged base"
