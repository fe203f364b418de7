"""LoRA adapters: file layouts, parity with diffusers, merge/unmerge/clear exactness, stacking, errors that leave the
weights unchanged, the CLI, and the same behaviour on the mp executor and under torchrun with sp=2.

Test LoRA files are random low-rank weights for the embedded tiny model, written in every key layout by
distvideo.testing.lora_files. One inline generator serves most tests (loading one costs seconds on 2 cores).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import torch

from distvideo import VideoGenerator
from distvideo.cli.main import main
from distvideo.config import EngineConfig, LoraSpec
from distvideo.executors import resolve_engine
from distvideo.lora import LoraError, read_lora_file
from distvideo.lora.formats import diffusers_layer_name, parse_lora_state_dict
from distvideo.lora.rank import describe, lora_state, transformer_digest
from distvideo.media import write_video
from distvideo.testing.lora_files import LAYOUTS, random_lora_layers, save_lora_file, wan_layer_name
from launch_groups import torchrun_case

from background import run_python
from conftest import REPO, diffusers_frames, diffusers_pipeline, max_abs_diff
from launchers import format_output

# The helpers run on mp workers travel by value: the workers need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

REQUEST = dict(num_frames=5, height=32, width=48, num_inference_steps=2, seed=0, guidance_scale=5.0)
SMALL_FLAGS = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2", "--seed", "0"]
PROMPT = "a red fox"
ALPHA_B = 2.0  # adapter B is stored in the Wan layout with alpha 2 at rank 4: scale 0.5


# --- files ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layers_a(tiny_model):
    return random_lora_layers(tiny_model, rank=4, seed=1)


@pytest.fixture(scope="module")
def layers_b(tiny_model):
    return random_lora_layers(tiny_model, rank=4, seed=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory, layers_a, layers_b):
    """A in diffusers/PEFT naming (no alpha), B in the original Wan naming with alpha, and AB: one file holding
    A at strength 1 plus B at strength 0.5 (its alpha folded in) as a single rank-8 adapter."""
    d = tmp_path_factory.mktemp("lora")
    scale_b = 0.5 * ALPHA_B / 4
    summed = {
        name: (torch.cat([da, layers_b[name][0]]), torch.cat([ua, layers_b[name][1] * scale_b], dim=1))
        for name, (da, ua) in layers_a.items()
    }
    return {
        "a": save_lora_file(d / "a.safetensors", layers_a, layout="diffusers"),
        "b": save_lora_file(d / "b_wan.safetensors", layers_b, layout="wan", alpha=ALPHA_B),
        "ab": save_lora_file(d / "ab.safetensors", summed, layout="diffusers-bare"),
        "dir": d,
    }


# --- the shared generator ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gen(tiny_model):
    with VideoGenerator.from_pretrained(tiny_model, executor="inline") as g:
        yield g


@pytest.fixture(scope="module")
def base(gen):
    """Frames and weight digest of the base model (no adapter)."""
    gen.clear_lora_adapters()
    return {"frames": frames(gen), "digest": digest(gen)}


@pytest.fixture(scope="module")
def frames_a07(gen, files, base):
    """Frames with adapter A at strength 0.7 (the reference of the CLI, mp and torchrun tests)."""
    gen.set_lora_adapter("a", files["a"], strength=0.7)
    out = frames(gen)
    gen.clear_lora_adapters()
    return out


@pytest.fixture(autouse=True)
def _no_adapter_left(request):
    yield
    if "gen" in request.fixturenames:
        request.getfixturevalue("gen").clear_lora_adapters()


def frames(g) -> np.ndarray:
    return g.generate(PROMPT, save_video=False, **REQUEST).frames


def digest(g) -> str:
    return g.collective_rpc(transformer_digest)[0]


def state(g) -> dict:
    return g.collective_rpc(describe)[0]


def transformer_of(g):
    return g.executor.worker.pipeline.transformer


# --- file layouts (no model) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wan", "diffusers"),
    [
        ("blocks.0.self_attn.q", "blocks.0.attn1.to_q"),
        ("blocks.3.self_attn.o", "blocks.3.attn1.to_out.0"),
        ("blocks.12.cross_attn.v", "blocks.12.attn2.to_v"),
        ("blocks.1.cross_attn.k_img", "blocks.1.attn2.add_k_proj"),
        ("blocks.0.ffn.0", "blocks.0.ffn.net.0.proj"),
        ("blocks.0.ffn.2", "blocks.0.ffn.net.2"),
        ("head.head", "proj_out"),
        ("time_projection.1", "condition_embedder.time_proj"),
        ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
        ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
        ("blocks.0.attn1.to_q", "blocks.0.attn1.to_q"),  # diffusers names pass through
    ],
)
def test_wan_layer_names_map_to_diffusers(wan, diffusers):
    assert diffusers_layer_name(wan) == diffusers
    if wan != diffusers and "img" not in wan:
        assert wan_layer_name(diffusers) == wan


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reads_to_the_same_layers(tmp_path, layers_a, layout):
    path = save_lora_file(tmp_path / "x.safetensors", layers_a, layout=layout, alpha=8.0)
    parsed = read_lora_file(path)
    assert sorted(parsed.layers) == sorted(layers_a)
    for name, (down, up) in layers_a.items():
        assert torch.equal(parsed.layers[name].down, down) and torch.equal(parsed.layers[name].up, up)
        assert parsed.layers[name].scale == 2.0  # alpha 8 / rank 4


def test_parse_errors_name_the_problem():
    A, B = torch.zeros(4, 32), torch.zeros(32, 4)
    with pytest.raises(LoraError, match=r"not LoRA tensors.*blocks\.0\.attn1\.to_q\.weight"):
        parse_lora_state_dict({"blocks.0.attn1.to_q.weight": B @ A}, source="f.safetensors")
    with pytest.raises(LoraError, match=r"blocks\.0\.attn1\.to_q has a down .* but no up"):
        parse_lora_state_dict({"blocks.0.attn1.to_q.lora_A.weight": A}, source="f.safetensors")
    with pytest.raises(LoraError, match=r"blocks\.0\.attn1\.to_q has lora_A of shape \(4, 32\) and lora_B"):
        bad = {"blocks.0.attn1.to_q.lora_A.weight": A, "blocks.0.attn1.to_q.lora_B.weight": torch.zeros(32, 3)}
        parse_lora_state_dict(bad, source="f.safetensors")
    # deltas of normalisation layers are skipped, as diffusers skips them
    layers, skipped = parse_lora_state_dict(
        {
            "diffusion_model.blocks.0.norm3.diff": torch.zeros(32),
            "diffusion_model.blocks.0.ffn.0.diff_b": torch.ones(64),
        }
    )
    assert skipped == ["diffusion_model.blocks.0.norm3.diff"]
    assert torch.equal(layers["blocks.0.ffn.net.0.proj"].bias, torch.ones(64))


# --- semantics on one rank -----------------------------------------------------------------------------------------


def test_strength_zero_is_the_base(gen, files, base):
    gen.set_lora_adapter("a", files["a"], strength=0.0)
    assert digest(gen) == base["digest"]
    assert np.array_equal(frames(gen), base["frames"])


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_model, files):
    pipe = diffusers_pipeline(tiny_model)
    with warnings.catch_warnings():  # peft warns that a second adapter joins the first: that is the point
        warnings.simplefilter("ignore", UserWarning)
        pipe.load_lora_weights(str(files["a"]), adapter_name="a")
        pipe.load_lora_weights(str(files["b"]), adapter_name="b")
    return pipe


def diffusers_lora_frames(pipe, adapters: list[str], weights: list[float]) -> np.ndarray:
    pipe.set_adapters(adapters, weights)
    return diffusers_frames(pipe, PROMPT, **REQUEST)


@pytest.mark.slow
@pytest.mark.parametrize(
    "adapters",
    [
        pytest.param([("a", 1.0)], id="diffusers-naming"),
        pytest.param([("b", 0.6)], id="wan-naming-with-alpha"),
    ],
)
def test_frames_match_diffusers_load_lora_weights(gen, files, base, diffusers_pipe, adapters):
    for i, (name, strength) in enumerate(adapters):
        gen.set_lora_adapter(name, files[name], strength=strength, accumulate=i > 0)
    ours = frames(gen)
    ref = diffusers_lora_frames(diffusers_pipe, [n for n, _ in adapters], [s for _, s in adapters])
    assert max_abs_diff(ref, base["frames"]) > 20, "the adapter hardly changes the frames: the check would be weak"
    assert max_abs_diff(ours, ref) <= 2


def test_unmerged_applies_on_the_fly_over_exact_base_weights(gen, files, base, frames_a07):
    gen.set_lora_adapter("a", files["a"], strength=0.7)
    merged = digest(gen)
    gen.unmerge_lora_weights()
    assert digest(gen) == base["digest"], "unmerged: the weights are the base weights, bit for bit"
    assert state(gen)["merged"] is False and state(gen)["active"] == [["a", 0.7]]
    assert max_abs_diff(frames(gen), frames_a07) <= 2
    gen.merge_lora_weights()
    assert digest(gen) == merged


def test_many_cycles_then_clear_restore_base_bit_for_bit(gen, files, base):
    gen.set_lora_adapter("a", files["a"], strength=0.7)
    merged_digest = digest(gen)
    gen.set_lora_adapter("b", files["b"], strength=0.3, accumulate=True)
    for i in range(20):
        gen.unmerge_lora_weights()
        gen.merge_lora_weights()
        gen.set_lora_adapter("a", strength=0.7)  # switch (cached) ...
        gen.set_lora_adapter("b", strength=0.3 + i / 100, accumulate=True)  # ... and stack again
    gen.set_lora_adapter("a", strength=0.7)
    assert digest(gen) == merged_digest, "merging recomputes from the saved base: no drift"
    gen.clear_lora_adapters()
    assert digest(gen) == base["digest"]
    cleared = state(gen)  # other tests may have cached adapters of their own in the shared generator
    assert (cleared["active"], cleared["merged"], cleared["touched_layers"]) == ([], True, 0)
    assert {"a", "b"} <= set(cleared["cached"])
    assert np.array_equal(frames(gen), base["frames"])


def test_accumulate_equals_one_adapter_holding_the_sum(gen, files):
    gen.set_lora_adapter("ab", files["ab"])
    summed = {k: v.clone() for k, v in transformer_of(gen).state_dict().items()}
    gen.set_lora_adapter("a", files["a"], strength=1.0)
    gen.set_lora_adapter("b", files["b"], strength=0.5, accumulate=True)
    stacked = transformer_of(gen).state_dict()
    changed = [k for k in summed if not torch.equal(summed[k], stacked[k])]
    assert changed, "float rounding differs between the two ways; equal bits would mean nothing was applied"
    for k, v in summed.items():
        torch.testing.assert_close(stacked[k], v, rtol=0, atol=1e-6)


def test_replace_switch_and_stack(gen, files):
    gen.set_lora_adapter("a", files["a"], strength=0.5)
    gen.set_lora_adapter("b", files["b"])  # replaces A
    assert state(gen)["active"] == [["b", 1.0]]
    gen.set_lora_adapter("a", accumulate=True)  # cached: no path needed
    assert state(gen)["active"] == [["b", 1.0], ["a", 1.0]]
    gen.set_lora_adapter("b", strength=0.25, accumulate=True)  # re-stacking moves it last with the new strength
    assert state(gen)["active"] == [["a", 1.0], ["b", 0.25]]


def _other_model_file(path, layers_a):
    # a 3-block model's adapter: blocks 0-1 match, block 2 does not exist here
    extra = {name.replace("blocks.1.", "blocks.2."): t for name, t in layers_a.items() if name.startswith("blocks.1.")}
    return save_lora_file(path, {**layers_a, **extra}, layout="wan")


def _wrong_shapes_file(path, layers_a):
    _, up = layers_a["blocks.0.attn1.to_q"]
    return save_lora_file(path, {"blocks.0.attn1.to_q": (torch.zeros(4, 64), up)}, layout="diffusers")


def _no_match_file(path, layers_a):
    from safetensors.torch import save_file

    save_file(
        {
            "unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.zeros(4, 8),
            "unet.down_blocks.0.attentions.0.proj_in.lora_B.weight": torch.zeros(8, 4),
        },
        str(path),
    )
    return path


def _corrupt_file(path, layers_a):
    good = save_lora_file(path, layers_a, layout="diffusers").read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated download
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        pytest.param(None, r"does not exist", id="missing"),
        pytest.param(_corrupt_file, r"not a valid \.safetensors file .*corrupt", id="corrupt"),
        pytest.param(_no_match_file, r"matches no layer of this model's transformer.*for another model", id="no-match"),
        pytest.param(_other_model_file, r"10 of its 30 layers match no linear layer.*blocks\.2\.", id="more-blocks"),
        pytest.param(
            _wrong_shapes_file, r"layer blocks\.0\.attn1\.to_q is Linear\(in_features=32.*\(rank, 32\)", id="shapes"
        ),
    ],
)
def test_bad_files_are_clear_errors_and_change_nothing(gen, files, layers_a, tmp_path, make, expected):
    gen.set_lora_adapter("a", files["a"], strength=0.7)
    before, state_before = digest(gen), state(gen)
    path = tmp_path / "bad.safetensors"
    if make is not None:
        make(path, layers_a)
    with pytest.raises(LoraError, match=expected) as info:
        gen.set_lora_adapter("bad", path, accumulate=True)
    assert str(path) in str(info.value), "the error names the file"
    assert "weights are unchanged" in str(info.value)
    assert digest(gen) == before and state(gen) == state_before


def test_unknown_nickname_and_bad_arguments(gen):
    with pytest.raises(LoraError, match=r"no LoRA adapter named 'nope' is loaded"):
        gen.set_lora_adapter("nope")
    with pytest.raises(LoraError, match="strength must be a finite number"):
        gen.set_lora_adapter("a", "x.safetensors", strength=float("nan"))
    with pytest.raises(LoraError, match="nickname"):
        gen.set_lora_adapter("", "x.safetensors")


# --- CLI -----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_lora_flag_end_to_end(gen, files, frames_a07, tmp_path, capsys):
    out = tmp_path / "cli.mp4"
    argv = ["generate", "--prompt", PROMPT, "--executor", "inline", "--output", str(out), "--no-progress"]
    assert main([*argv, *SMALL_FLAGS, "--lora", f"{files['a']}:0.7"]) == 0, capsys.readouterr().err
    expected = write_video(frames_a07, tmp_path / "api.mp4", fps=16)  # the API's frames, through the same encoder
    assert out.read_bytes() == expected.read_bytes()


def test_engine_lora_list_stacks_in_order(gen, files, tiny_model):
    """--lora given twice, or engine.lora in a config file: the first replaces, the next ones stack."""
    specs = [LoraSpec(str(files["a"]), 0.7), LoraSpec(str(files["b"]), 0.5), LoraSpec(str(files["a"]), 0.1)]
    with VideoGenerator.from_pretrained(tiny_model, executor="inline", lora=specs) as stacked:
        assert state(stacked)["active"] == [["a", 0.7], ["b_wan", 0.5], ["a#2", 0.1]]
        stacked_digest = digest(stacked)
    gen.set_lora_adapter("a", files["a"], strength=0.7)
    gen.set_lora_adapter("b_wan", files["b"], strength=0.5, accumulate=True)
    gen.set_lora_adapter("a#2", files["a"], strength=0.1, accumulate=True)
    assert digest(gen) == stacked_digest


@pytest.mark.parametrize(("executor", "num_gpus"), [("inline", 1), ("mp", 2)])
def test_a_missing_lora_file_is_refused_before_any_rank_starts(tmp_path, tiny_model, executor, num_gpus):
    """resolve_engine (which starts no process and reads no weights) names the file: before, the model loaded on
    every rank first and the error came from set_lora_adapter."""
    missing = tmp_path / "nowhere.safetensors"
    config = EngineConfig(model=str(tiny_model), executor=executor, num_gpus=num_gpus, lora=[LoraSpec(str(missing))])
    with pytest.raises(LoraError, match=rf"LoRA file '{missing}' does not exist on host"):
        resolve_engine(config)
    (tmp_path / "two").mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (tmp_path / "two" / name).write_bytes(b"")
    config = EngineConfig(
        model=str(tiny_model), executor=executor, num_gpus=num_gpus, lora=[LoraSpec(str(tmp_path / "two"))]
    )
    with pytest.raises(LoraError, match=r"is a folder with 2 \.safetensors files \(a.safetensors, b.safetensors\)"):
        resolve_engine(config)


def test_cli_missing_lora_file_exits_2(tmp_path, capsys):
    missing = tmp_path / "nowhere.safetensors"
    argv = ["generate", "--prompt", PROMPT, "--executor", "inline", "--output", str(tmp_path / "v.mp4")]
    assert main([*argv, *SMALL_FLAGS, "--lora", f"{missing}:0.7"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err
    assert not (tmp_path / "v.mp4").exists()


# --- other executors -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mp_gen(tiny_model):
    with VideoGenerator.from_pretrained(tiny_model, executor="mp", num_gpus=2) as mp:
        yield mp


@pytest.mark.slow
def test_mp_two_ranks_equals_inline(mp_gen, files, frames_a07):
    mp = mp_gen
    mp.clear_lora_adapters()
    base = mp.collective_rpc(transformer_digest)
    assert mp.engine.layout.describe() == "world 2 = cfg 2 x sp 1"
    mp.set_lora_adapter("a", files["a"], strength=0.7)
    # cfg=2 is another layout than one rank: within 2 (test_parallel_torchrun.py); the same layout under torchrun
    # gives these frames bit for bit (test_torchrun_sp2_cfg2_transaction_and_parity)
    assert max_abs_diff(frames(mp), frames_a07) <= 2
    with_a = mp.collective_rpc(transformer_digest)
    assert with_a[0] == with_a[1] != base[0]
    with pytest.raises(LoraError, match=r"failed on rank\(s\) 0, 1 of 2") as info:
        mp.set_lora_adapter("b", files["dir"] / "missing.safetensors", accumulate=True)
    assert "missing.safetensors" in str(info.value)
    assert mp.collective_rpc(transformer_digest) == with_a
    mp.unmerge_lora_weights()
    assert mp.collective_rpc(transformer_digest) == base
    mp.clear_lora_adapters()
    assert mp.collective_rpc(transformer_digest) == base


def plant_weight_write_failure(worker, victim: int, after: int) -> None:
    """On rank `victim`, the weight write after `after` successful ones (merged or base, in any LoRA step) raises,
    once: the step fails there half-way, with some layers already changed. Then the plant is gone."""
    if worker.rank != victim:
        return
    state = lora_state(worker)
    writes = {"count": 0}
    names = ("_write_merged", "_write_base")

    def failing(name):
        method = getattr(type(state), name).__get__(state)

        def write(*args, **kwargs):
            writes["count"] += 1
            if writes["count"] > after:
                for planted in names:
                    vars(state).pop(planted, None)
                raise RuntimeError(f"planted failure in {name} on rank {worker.rank}")
            return method(*args, **kwargs)

        return write

    for name in names:
        setattr(state, name, failing(name))


def lora_snapshot(gen) -> tuple[list[str], list[dict]]:
    return gen.collective_rpc(transformer_digest), gen.collective_rpc(describe)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["commit", "merge", "unmerge", "clear"])
def test_a_step_failing_on_one_rank_rolls_every_rank_back(mp_gen, files, step):
    """commit (set_lora_adapter), merge, unmerge or clear fails on rank 1 half-way through its layers: every rank is
    back where it was, bit for bit (weights, active adapters, merge mode, cache), and the generator still works."""
    mp = mp_gen
    mp.clear_lora_adapters()
    mp.set_lora_adapter("a", files["a"], strength=0.7)
    if step == "merge":
        mp.unmerge_lora_weights()
    calls = {
        "commit": lambda: mp.set_lora_adapter("b", files["b"], strength=0.5, accumulate=True),
        "merge": mp.merge_lora_weights,
        "unmerge": mp.unmerge_lora_weights,
        "clear": mp.clear_lora_adapters,
    }
    before = lora_snapshot(mp)
    mp.collective_rpc(plant_weight_write_failure, args=(1, 3))
    with pytest.raises(RuntimeError, match=r"rank 1: RuntimeError: planted failure in _write_(merged|base) on rank 1"):
        calls[step]()
    after = lora_snapshot(mp)
    assert after == before, f"{step} failed on rank 1 and left the ranks at {after[1]}, not {before[1]}"
    calls[step]()  # the failure fired once: the same step now succeeds on every rank
    digests = mp.collective_rpc(transformer_digest)
    assert digests[0] == digests[1] != before[0][0]
    mp.clear_lora_adapters()


# --- folders, refusals, and diffusers' own reading of every layout -------------------------------------------------
def test_a_folder_is_read_like_diffusers_save_lora_weights_writes_it(gen, files, layers_a, tmp_path):
    """A folder holding pytorch_lora_weights.safetensors (what diffusers' save_lora_weights writes) is that file, even
    beside others; a folder with exactly one .safetensors file is that file; with several, none or only a .bin, a
    LoraError says what the folder holds and changes nothing."""
    gen.set_lora_adapter("a", files["a"], strength=0.7)
    expected = digest(gen)
    gen.clear_lora_adapters()
    diffusers_folder = tmp_path / "diffusers"
    save_lora_file(diffusers_folder / "pytorch_lora_weights.safetensors", layers_a, layout="diffusers")
    save_lora_file(diffusers_folder / "other.safetensors", {}, layout="diffusers")  # an unrelated, empty file
    single = tmp_path / "single"
    save_lora_file(single / "my_style.safetensors", layers_a, layout="wan")
    for folder in (diffusers_folder, single):
        gen.set_lora_adapter("folder", folder, strength=0.7)
        assert digest(gen) == expected, folder
        gen.clear_lora_adapters()
    base = digest(gen)
    several = tmp_path / "several"
    for name in ("x", "y"):
        save_lora_file(several / f"{name}.safetensors", layers_a)
    (tmp_path / "empty").mkdir()
    for folder, count in ((several, 2), (tmp_path / "empty", 0)):
        with pytest.raises(LoraError, match=rf"is a folder with {count} \.safetensors files"):
            gen.set_lora_adapter("folder", folder)
        assert digest(gen) == base


def _dora_file(path, layers_a):
    file = save_lora_file(path, layers_a, layout="diffusers")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    tensors["transformer.blocks.0.attn1.to_q.lora_magnitude_vector"] = torch.ones(32)  # PEFT's DoRA magnitude
    save_file(tensors, str(file))
    return file


def _lokr_file(path, layers_a):
    from safetensors.torch import save_file

    save_file(
        {
            "lora_unet_blocks_0_self_attn_q.lokr_w1": torch.zeros(4, 4),
            "lora_unet_blocks_0_self_attn_q.lokr_w2": torch.zeros(8, 8),
        },
        str(path),
    )
    return path


def _pickle_file(path, layers_a):
    torch.save({f"transformer.{n}.lora_A.weight": d for n, (d, _) in layers_a.items()}, str(path))
    return path


@pytest.mark.parametrize(
    ("make", "name", "expected"),
    [
        pytest.param(
            _dora_file, "dora.safetensors", r"lora_magnitude_vector.*DoRA and LoKr files are not supported", id="dora"
        ),
        pytest.param(_lokr_file, "lokr.safetensors", r"lokr_w1.*DoRA and LoKr files are not supported", id="lokr"),
        pytest.param(
            _pickle_file, "adapter.pt", r"not a valid \.safetensors file.*Only \.safetensors LoRA files", id="pickle"
        ),
    ],
)
def test_unsupported_files_are_refused_and_change_nothing(gen, layers_a, tmp_path, make, name, expected):
    before, state_before = digest(gen), state(gen)
    path = make(tmp_path / name, layers_a)
    with pytest.raises(LoraError, match=expected):
        gen.set_lora_adapter("unsupported", path)
    assert digest(gen) == before and state(gen) == state_before


def test_fused_projections_are_refused(tiny_model, files):
    """Fused q/k/v projections (diffusers' fuse_projections) bypass the to_q/to_k/to_v layers a LoRA changes."""
    with VideoGenerator.from_pretrained(tiny_model, executor="inline") as fused:
        transformer = transformer_of(fused)
        for module in transformer.modules():
            if hasattr(module, "fuse_projections"):
                module.fuse_projections()
        assert any(getattr(m, "fused_projections", False) for m in transformer.modules())
        before = digest(fused)
        with pytest.raises(RuntimeError, match=r"unfused attention projections.*unfuse_projections"):
            fused.set_lora_adapter("a", files["a"])
        assert digest(fused) == before and state(fused)["active"] == []


@pytest.mark.parametrize("layout", ["wan", "musubi"])
def test_wan_and_musubi_layouts_read_as_diffusers_own_loader_reads_them(tiny_model, layers_b, tmp_path, layout):
    """The same file through diffusers' WanPipeline.lora_state_dict (its own conversion of these layouts, alpha folded
    into the matrices) and through distvideo: the same layers and the same weight change per layer."""
    from diffusers import WanPipeline

    path = save_lora_file(tmp_path / f"{layout}.safetensors", layers_b, layout=layout, alpha=ALPHA_B)
    theirs = WanPipeline.lora_state_dict(str(path))
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    ours = read_lora_file(path).layers
    their_layers = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in theirs}
    assert their_layers == set(ours) == set(layers_b)
    for name, weights in ours.items():
        down = theirs[f"transformer.{name}.lora_A.weight"].float()
        up = theirs[f"transformer.{name}.lora_B.weight"].float()
        torch.testing.assert_close(weights.up @ weights.down * weights.scale, up @ down, rtol=1e-5, atol=1e-7)
    assert ours[name].scale == ALPHA_B / 4  # alpha 2 at rank 4: a check that would be weak at scale 1


# adapters A and B as the fixtures `files` write them, in a process of its own
WRITE_FILES = (
    "import sys; from distvideo.models.embedded import tiny_model_path as m; "
    "from distvideo.testing.lora_files import random_lora_layers as r, save_lora_file as s; "
    "s(sys.argv[1] + '/a.safetensors', r(m(), rank=4, seed=1), layout='diffusers'); "
    f"s(sys.argv[1] + '/b_wan.safetensors', r(m(), rank=4, seed=2), layout='wan', alpha={ALPHA_B})"
)


def _torchrun_argv(folder: Path, environ: dict[str, str]) -> list[str]:
    run_python(WRITE_FILES, [str(folder)], environ)
    (folder / "out").mkdir()
    script = REPO / "tests" / "rank_scripts" / "lora_ranks.py"
    return [str(script), str(folder / "out"), str(folder / "a.safetensors"), str(folder / "b_wan.safetensors")]


# a launch whose outcome is all the test checks: in the background, in turn with other modules' scripts
# (launch_groups.py)
TORCHRUN = torchrun_case("LoRA under torchrun", 2, _torchrun_argv, timeout=600)
BACKGROUND_JOBS = {"torchrun_launch": TORCHRUN.hooks}


torchrun_launch = TORCHRUN.fixture("torchrun_launch")


@pytest.mark.launcher
@pytest.mark.slow
def test_torchrun_sp2_cfg2_transaction_and_parity(torchrun_launch, files, frames_a07, mp_gen):
    folder, proc = torchrun_launch
    assert proc.returncode == 0, format_output(proc)
    for name, file in (("a.safetensors", files["a"]), ("b_wan.safetensors", files["b"])):
        assert (folder / name).read_bytes() == file.read_bytes(), f"the launch's {name} is not the module's"
    tmp_path = folder / "out"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1, "every rank saw the same digests, states and errors"
    # a LoRA on sp=2 (merged, and on the fly) and on cfg=2 gives the single-rank frames within 2 (other layouts)
    for name in ("lora", "lora_unmerged", "lora_cfg"):
        assert max_abs_diff(np.load(tmp_path / f"{name}.npy"), frames_a07) <= 2, name
    # cfg=2 under torchrun is the mp executor's cfg=2, bit for bit (the same layout; lora_ranks.py's request is
    # REQUEST, with the model's default guidance 5.0)
    assert mp_gen.engine.layout.describe() == "world 2 = cfg 2 x sp 1"
    mp_gen.clear_lora_adapters()
    mp_gen.set_lora_adapter("a", files["a"], strength=0.7)
    mp_cfg = frames(mp_gen)
    mp_gen.clear_lora_adapters()
    torchrun_cfg = np.load(tmp_path / "lora_cfg.npy")
    assert np.array_equal(torchrun_cfg, mp_cfg), f"max abs difference {max_abs_diff(torchrun_cfg, mp_cfg)}"
    base, with_a = r0["base"], r0["with_a"]
    assert r0["unmerged"] == base
    assert base[0] == base[1] and with_a[0] == with_a[1] and with_a != base
    # the file exists on rank 0 only: the same error on both ranks, naming rank 1, and no weight changed anywhere
    failure = r0["missing_on_rank_1"]
    assert failure["type"] == "LoraError"
    assert "failed on rank(s) 1 of 2; no rank changed its weights" in failure["message"]
    assert "rank 1: LoRA file" in failure["message"] and "only-on-rank-0" in failure["message"]
    assert "rank 0:" not in failure["message"]
    assert r0["after_failure"] == with_a and r0["state_after_failure"] == r0["state_with_a"]
    assert "the ranks read different files" in r0["different_files"]["message"]
    assert r0["after_different_files"] == with_a
    assert r0["divergent_is_refused"], r0["divergent"]
    # a non-finite strength on rank 1 only: both ranks refuse the call, naming the invalid argument
    invalid = r0["invalid_on_one_rank"]
    assert invalid["type"] == "DivergentCallError", invalid
    assert "invalid_arguments" in invalid["message"] and "strength must be a finite number" in invalid["message"]
    assert r0["after_clear"] == base


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
