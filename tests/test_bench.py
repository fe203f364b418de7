"""`distvideo bench`: the analytic FLOP count, the JSON report, and bad input refused before any loading."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from distvideo.bench import run as bench_run  # a submodule: `bench.run` exists only once something imported it
from distvideo.cli.main import main
from distvideo.families.wan.flops import wan_transformer_flops, wan_transformer_flops_breakdown
from distvideo.models.embedded import tiny_model_path

from background import FolderJob
from launchers import format_output, run_launcher

# 1 layer, 2 heads x 4 = dim 8, ffn 16; latents (1, 4, 2, 4, 6) -> 2 x 2 x 3 = 12 tokens; 5 text tokens
TINY = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 4,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 6,
    "freq_dim": 10,
    "ffn_dim": 16,
    "num_layers": 1,
    "image_dim": None,
    "added_kv_proj_dim": None,
}
LATENTS = (1, 4, 2, 4, 6)
TEXT_LEN = 5


def test_flop_count_matches_hand_count():
    S, D, L, F = 12, 8, 5, 16  # tokens, model width, text tokens, ffn width
    C, P, freq, text_dim = 4, 1 * 2 * 2, 10, 6  # channels, patch volume
    expected = {
        "patch_embedding": 2 * S * D * (C * P),  # Conv3d with stride = kernel: one matmul
        "condition_embedder": 2 * (freq * D + D * D + D * 6 * D) + 2 * L * (text_dim * D + D * D),
        "self_attention_proj": 4 * (2 * S * D * D),  # q, k, v, out
        "self_attention": 2 * (2 * S * S * D),  # QK^T and AV over all heads
        "cross_attention_proj": 2 * (2 * S * D * D) + 2 * (2 * L * D * D),  # q, out on video; k, v on text
        "cross_attention": 2 * (2 * S * L * D),
        "ffn": 2 * (2 * S * D * F),
        "proj_out": 2 * S * D * (C * P),
    }
    assert expected == {
        "patch_embedding": 3072,
        "condition_embedder": 2176,
        "self_attention_proj": 6144,
        "self_attention": 4608,
        "cross_attention_proj": 4352,
        "cross_attention": 1920,
        "ffn": 6144,
        "proj_out": 3072,
    }
    assert wan_transformer_flops_breakdown(TINY, LATENTS, TEXT_LEN) == expected
    assert wan_transformer_flops(TINY, LATENTS, TEXT_LEN) == sum(expected.values()) == 31488


BLOCK_PARTS = ("self_attention_proj", "self_attention", "cross_attention_proj", "cross_attention", "ffn")


def test_flop_count_scales_with_layers_batch_and_tokens():
    one = wan_transformer_flops_breakdown(TINY, LATENTS, TEXT_LEN)
    two = wan_transformer_flops_breakdown({**TINY, "num_layers": 2}, LATENTS, TEXT_LEN)
    for part in one:
        assert two[part] == (2 * one[part] if part in BLOCK_PARTS else one[part]), part
    batch2 = wan_transformer_flops_breakdown(TINY, (2, *LATENTS[1:]), TEXT_LEN)
    assert all(batch2[p] == 2 * one[p] for p in one)
    frames2 = wan_transformer_flops_breakdown(TINY, (1, 4, 4, 4, 6), TEXT_LEN)  # twice the tokens
    assert frames2["self_attention"] == 4 * one["self_attention"]
    assert frames2["ffn"] == 2 * one["ffn"] and frames2["cross_attention"] == 2 * one["cross_attention"]
    with pytest.raises(ValueError, match="patch_size"):
        wan_transformer_flops(TINY, (1, 4, 2, 5, 6), TEXT_LEN)


def test_flop_count_matches_torch_flop_counter_on_diffusers_model():
    """The same count as torch's FlopCounterMode over a real WanTransformer3DModel forward (it counts matmuls,
    convolutions and attention; CPU's fused attention kernel gets the SDPA formula)."""
    from diffusers import WanTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    config = {**TINY, "num_layers": 2}
    model = WanTransformer3DModel(**{k: v for k, v in config.items() if k != "patch_size"}, patch_size=(1, 2, 2))

    def cpu_sdpa(query_shape, key_shape, value_shape, *args, **kwargs):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
    latents = (2, 4, 2, 4, 6)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(
            hidden_states=torch.randn(latents),
            timestep=torch.tensor([10, 20]),
            encoder_hidden_states=torch.randn(2, TEXT_LEN, 6),
            return_dict=False,
        )
    assert counter.get_total_flops() == wan_transformer_flops(config, latents, TEXT_LEN)


SMALL = ["--num-frames", "5", "--height", "32", "--width", "32", "--steps", "2"]


def _is_positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def test_bench_json_report_against_diffusers(tmp_path, tiny_model, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(tiny_model), *SMALL, "--runs", "1", "--warmup", "0"]
    assert main([*args, "--compare", "diffusers", "--json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())

    for side in ("distvideo", "diffusers"):
        figures = report[side]
        assert _is_positive_number(figures["e2e_s"]), side
        assert set(figures["stages"]) >= {"text_encoding", "denoising", "decoding"}
        assert all(_is_positive_number(v) for v in figures["stages"].values()), figures["stages"]
        assert sum(figures["stages"][s] for s in ("text_encoding", "denoising", "decoding")) <= figures["e2e_s"]
        assert _is_positive_number(figures["peak_memory_mb"])
        assert 0 < figures["mfu"] < 1 and _is_positive_number(figures["achieved_flops"])
    assert _is_positive_number(report["ratio_e2e"])
    assert report["ratio_e2e"] == report["ratios"]["e2e_s"]
    assert set(report["ratios"]) >= {"text_encoding", "denoising", "decoding", "peak_memory_mb"}
    env = report["env"]
    assert env["torch"] == torch.__version__ and isinstance(env["diffusers"], str)
    assert env["world_size"] == 1 and env["threads"] == torch.get_num_threads() and env["device"] == "cpu"
    cfg = report["config"]
    assert (cfg["num_frames"], cfg["height"], cfg["width"], cfg["steps"]) == (5, 32, 32, 2)
    assert cfg["transformer_forwards"] == 4  # 2 steps x 2 (CFG)
    assert cfg["transformer_flops_per_forward"] == sum(cfg["transformer_flops_breakdown"].values()) > 0
    assert len(report["runs"]) == 1
    run = report["runs"][0]
    assert run["diffusers"]["transformer_forwards"] == cfg["transformer_forwards"]
    assert _is_positive_number(run["matmul_flops_per_rank"][0])
    assert report["check"]["frames_max_abs_diff"] <= 2, "the two pipelines did not compute the same video"

    table = capsys.readouterr().out
    for text in ("distvideo", "diffusers", "ratio", "end to end", "denoising", "MFU", "matmul peak"):
        assert text in table


def test_bench_without_comparison_reports_distvideo_only(tmp_path, tiny_model, capsys):
    out = tmp_path / "alone.json"
    assert main(["bench", "--model", str(tiny_model), *SMALL, "--steps", "1", "--runs", "1", "--warmup", "0",
                 "--guidance-scale", "1", "--json", str(out), "--no-progress"]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    assert report["diffusers"] is None and report["ratio_e2e"] is None and report["ratios"] is None
    assert report["config"]["transformer_forwards"] == 1  # no CFG
    assert 0 < report["distvideo"]["mfu"] < 1
    assert "distvideo" in capsys.readouterr().out


BAD_INPUTS = [
    (["--model", "/nonexistent/model"], "--model"),
    (["--runs", "0"], "--runs"),
    (["--warmup", "-1"], "--warmup"),
    (["--height", "50"], "--height 50"),
    (["--num-frames", "10"], "--num-frames 10"),
    (["--steps", "0"], "--steps 0"),
    (["--json", "/nonexistent/folder/out.json"], "--json"),
    (["--compare", "comfyui"], "--compare"),
    (["--lora", "style.safetensors"], "--lora"),  # diffusers would run without it
]


@pytest.mark.parametrize(("extra", "named"), BAD_INPUTS, ids=[n for _, n in BAD_INPUTS])
@pytest.mark.usefixtures("no_weights_loaded")
def test_bad_input_exits_2_before_loading(extra, named, tmp_path, capsys, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("diffusers' pipeline was loaded for a bad request")

    monkeypatch.setattr(bench_run, "DiffusersBaseline", no_loading)
    args = ["bench", *SMALL, "--compare", "diffusers", "--json", str(tmp_path / "out.json"), *extra]
    assert main(args) == 2
    assert named in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def check_multi_rank_report(report: dict, executor: str) -> None:
    """What a 2-rank report must hold: no diffusers side (it runs on one rank) with a note saying so, and every rank's
    own peak memory, the largest of which is the headline figure."""
    assert report["diffusers"] is None and report["ratio_e2e"] is None and report["ratios"] is None
    assert any("skipped" in note and "2 ranks" in note for note in report["notes"]), report["notes"]
    env = report["env"]
    assert env["world_size"] == 2 and env["executor"] == executor and len(env["threads_per_rank"]) == 2
    ours = report["distvideo"]
    peaks = ours["peak_memory_mb_per_rank"]
    assert len(peaks) == 2 and all(p > 100 for p in peaks), peaks  # each rank is a process holding torch and a model
    assert ours["peak_memory_mb"] == max(peaks)
    weights, above = ours["weights_mb_per_rank"], ours["peak_above_loaded_mb_per_rank"]
    assert len(weights) == 2 and weights[0] == weights[1] > 0.8, weights  # unsharded: every rank holds the model
    assert len(above) == 2 and all(0 < a < p for a, p in zip(above, peaks, strict=True)), (above, peaks)
    assert 0 < ours["mfu"] < 1 and _is_positive_number(ours["e2e_s"])
    assert len(report["runs"]) == 1 and len(report["runs"][0]["distvideo"]["peak_memory_mb_per_rank"]) == 2
    assert report["config"]["transformer_forwards"] == 4  # 2 steps x 2 branches, as on one rank


BENCH_2 = [*SMALL, "--runs", "1", "--warmup", "0", "--compare", "diffusers", "--no-progress"]


@pytest.mark.slow
def test_bench_on_two_mp_ranks(tmp_path, tiny_model, capsys, monkeypatch):
    monkeypatch.setattr(bench_run, "DiffusersBaseline", lambda *a, **k: pytest.fail("diffusers started for 2 ranks"))
    out = tmp_path / "mp.json"
    assert main(["bench", "--model", str(tiny_model), "--num-gpus", "2", *BENCH_2, "--json", str(out)]) == 0
    check_multi_rank_report(json.loads(out.read_text()), "mp")
    assert "skipped" in capsys.readouterr().out


def _parameter_mb(model_dir, *components: str) -> float:
    """MiB of the parameters (not the buffers) of the checkpoint's `components` as loaded on CPU (float32)."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5EncoderModel

    loaders = {
        "transformer": lambda path: WanTransformer3DModel.from_pretrained(path, torch_dtype=torch.float32),
        "text_encoder": lambda path: UMT5EncoderModel.from_pretrained(path, dtype=torch.float32),
    }
    total = 0
    for name in components:
        module = loaders[name](str(model_dir / name))
        total += sum(p.numel() * p.element_size() for p in module.parameters())
    return total / 2**20


@pytest.mark.slow
def test_bench_reports_the_weights_each_rank_holds_under_sharding(tmp_path, tiny_model):
    """`--shard-weights all` over two sp ranks: each rank holds its share of the transformer's and the text
    encoder's parameters (FSDP2 splits every one of them over the two, unevenly where a dimension is odd), the rest
    (VAE, buffers) whole; so the two ranks together hold one rank's unsharded weights twice less those parameters
    once, to the byte."""
    args = [*SMALL, "--runs", "1", "--warmup", "0", "--no-progress"]
    assert main(["bench", "--model", str(tiny_model), *args, "--json", str(tmp_path / "one.json")]) == 0
    sharded = [*args, "--num-gpus", "2", "--sp-size", "2", "--shard-weights", "all"]
    assert main(["bench", "--model", str(tiny_model), *sharded, "--json", str(tmp_path / "two.json")]) == 0
    (whole,) = json.loads((tmp_path / "one.json").read_text())["distvideo"]["weights_mb_per_rank"]
    shares = json.loads((tmp_path / "two.json").read_text())["distvideo"]["weights_mb_per_rank"]
    assert len(shares) == 2 and all(share < whole for share in shares), (shares, whole)
    parameters = _parameter_mb(tiny_model, "transformer", "text_encoder")
    assert sum(shares) == pytest.approx(2 * whole - parameters, abs=1e-9), (shares, whole, parameters)


def _bench_launch(folder: Path, environ: dict[str, str]) -> subprocess.CompletedProcess:
    """Every rank runs the same command (on the embedded model)."""
    out = folder / "reports"
    out.mkdir()
    argv = ["-m", "distvideo", "bench", "--model", str(tiny_model_path()), *BENCH_2, "--json", str(out / "bench.json")]
    return run_launcher("torchrun", argv, nproc=2, timeout=400, base=environ)


# a launch whose outcome is all the test checks: in the background (background.py). Not in the shared launch
# (launch_groups.py): the report's peak memory is the process's high-water mark, which a script run before it would
# have set (seen: a peak above the loaded weights of -0.02 MiB)
TORCHRUN = FolderJob("bench under torchrun", "bench-torchrun", _bench_launch)
BACKGROUND_JOBS = {"bench_launch": TORCHRUN.hooks}


bench_launch = TORCHRUN.fixture("bench_launch")


@pytest.mark.launcher
@pytest.mark.slow
def test_bench_under_torchrun(bench_launch):
    """Every rank runs the same command; rank 0 alone writes the report."""
    folder, proc = bench_launch
    out = folder / "reports"
    assert proc.returncode == 0, format_output(proc)
    assert [p.name for p in out.iterdir()] == ["bench.json"]
    check_multi_rank_report(json.loads((out / "bench.json").read_text()), "external")
    assert proc.stdout.count("wrote ") == 1, proc.stdout
