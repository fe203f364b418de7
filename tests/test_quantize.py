"""Low-precision weights (--quantize, --quantize-text-encoder) and the attention kernel (--attention): each mode runs
where it can and is refused where it cannot, before loading; the int8 mode's products run as int8 matrix products;
quantized frames are the same on every run and executor; LoRA adapters apply beside a quantized base."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distvideo import VideoGenerator
from distvideo.cli.main import main
from distvideo.config import EngineConfig
from distvideo.errors import ConfigError
from distvideo.models.quantize import DeviceKind, check_support, keeps_full_precision
from family_checkpoints import family_checkpoint
from launch_groups import torchrun_case
from rank_scripts.quantize_ranks import PROMPT, REQUEST, SP2
from test_hunyuan import hunyuan_checkpoint

from conftest import max_abs_diff


def frames(gen: VideoGenerator, **kwargs) -> np.ndarray:
    return gen.generate(PROMPT, **{**REQUEST, **kwargs}).frames


@pytest.fixture(scope="module")
def base(tiny_model):
    """The unquantized frames and weight report of the tiny model."""
    with VideoGenerator.from_pretrained(tiny_model, executor="inline", progress=False) as gen:
        result = gen.generate(PROMPT, **REQUEST)
    return result.frames, result.weights


@pytest.fixture(scope="module")
def int8_gen(tiny_model):
    with VideoGenerator.from_pretrained(tiny_model, executor="inline", quantize="int8", progress=False) as gen:
        yield gen


class _Ops(TorchDispatchMode):
    """The aten operators that ran, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_int8_runs_every_quantized_layer_as_an_int8_matrix_product(int8_gen, base):
    """The proof that W8A8 ran: one aten._int_mm per quantized linear layer in a forward of the transformer (not a
    dequantize-and-matmul fallback); the family's full-precision layers stay plain linear layers."""
    transformer = int8_gen._executor.worker.pipeline.transformer
    linears = {name: m for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    quantized = {name for name, m in linears.items() if type(m.weight).__module__.startswith("torchao")}
    kept = set(linears) - quantized
    full_precision = int8_gen.engine.model.family.full_precision
    assert quantized and all(not keeps_full_precision(name, full_precision) for name in quantized)
    assert kept and all(keeps_full_precision(name, full_precision) for name in kept), kept
    assert all(m.weight.qdata.dtype == torch.int8 for name, m in linears.items() if name in quantized)
    config = transformer.config
    tokens = torch.randn(1, config.in_channels, 2, 4, 4)
    text = torch.randn(1, 8, config.text_dim)
    with torch.no_grad(), _Ops() as seen:
        transformer(hidden_states=tokens, timestep=torch.tensor([500.0]), encoder_hidden_states=text)
    assert seen.ops.count("aten._int_mm") == len(quantized), (len(quantized), seen.ops.count("aten._int_mm"))
    report = int8_gen.collective_rpc(lambda worker: worker.weights)[0]
    assert report["transformer"]["quantized_modules"] == len(quantized)
    assert report["transformer"]["bytes"] < base[1]["transformer"]["bytes"]


@pytest.mark.parametrize("mode", ["int8", "int8-weight", "fp8-weight"])
def test_each_cpu_mode_runs_reports_its_weights_and_repeats_bit_for_bit(tiny_model, base, int8_gen, mode):
    base_frames, base_weights = base
    if mode == "int8":
        gen, close = int8_gen, None
    else:
        gen = close = VideoGenerator.from_pretrained(tiny_model, executor="inline", quantize=mode, progress=False)
    try:
        first = gen.generate(PROMPT, **REQUEST)
        again = frames(gen)
    finally:
        if close is not None:
            close.shutdown()
    assert np.array_equal(first.frames, again), "the same request on the same engine gave other frames"
    assert not np.array_equal(first.frames, base_frames), f"{mode} changed nothing: did it run?"
    weights = first.weights["transformer"]
    assert weights["mode"] == mode and weights["quantized_modules"] > 0
    assert weights["bytes"] < base_weights["transformer"]["bytes"]
    assert first.weights["text_encoder"] == {**base_weights["text_encoder"], "mode": "none"}


def test_text_encoder_quantization_is_its_own_switch(tiny_model, base):
    with VideoGenerator.from_pretrained(
        tiny_model, executor="inline", quantize_text_encoder="int8-weight", progress=False
    ) as gen:
        result = gen.generate(PROMPT, **REQUEST)
    assert result.weights["transformer"] == base[1]["transformer"]
    text = result.weights["text_encoder"]
    assert text["mode"] == "int8-weight" and text["quantized_modules"] > 0
    assert text["bytes"] < base[1]["text_encoder"]["bytes"]


def test_lora_applies_beside_a_quantized_base_and_clearing_gives_the_base_frames(int8_gen, tiny_model, tmp_path):
    """Adapters on a quantized base run as a separate full-precision path (never merged); switching adapters and
    clearing them leaves the quantized weights as loaded, and the frames of the base bit for bit."""
    from distvideo.testing.lora_files import build_random_lora

    gen = int8_gen
    plain = frames(gen)
    digest = gen.collective_rpc(lambda w: [t.qdata.sum().item() for t in _quantized_weights(w)])[0]
    a = build_random_lora(tiny_model, tmp_path / "a.safetensors", rank=4, seed=1)
    b = build_random_lora(tiny_model, tmp_path / "b.safetensors", rank=4, seed=2)
    gen.set_lora_adapter("a", str(a), strength=0.8)
    with_a = frames(gen)
    state = gen.collective_rpc(lambda w: w.lora["transformer"].describe())[0]
    assert state["separate"] is True and state["merged"] is False and state["active"] == [["a", 0.8]]
    gen.merge_lora_weights()  # stays a separate path on a quantized base
    assert np.array_equal(frames(gen), with_a)
    gen.set_lora_adapter("b", str(b), strength=0.8)
    assert not np.array_equal(frames(gen), with_a)
    gen.set_lora_adapter("a", strength=0.8)
    assert np.array_equal(frames(gen), with_a), "switching back to an adapter gave other frames"
    assert not np.array_equal(with_a, plain), "the adapter changed nothing"
    gen.clear_lora_adapters()
    assert np.array_equal(frames(gen), plain)
    assert gen.collective_rpc(lambda w: [t.qdata.sum().item() for t in _quantized_weights(w)])[0] == digest


def _quantized_weights(worker) -> list:
    modules = worker.pipeline.transformer.modules()
    return [m.weight for m in modules if type(getattr(m, "weight", None)).__module__.startswith("torchao")]


def test_step_caching_skips_steps_over_quantized_blocks(int8_gen):
    request = dict(num_inference_steps=8, cache="first-block", cache_threshold=5.0)
    first = int8_gen.generate(PROMPT, **{**REQUEST, **request})
    assert first.cache["skipped_steps"], first.cache
    assert np.array_equal(frames(int8_gen, **request), first.frames)


def _torchrun_argv(folder: Path, environ: dict[str, str]) -> list[str]:
    return [str(Path(__file__).parent / "rank_scripts" / "quantize_ranks.py"), str(folder / "out")]


# in the background, in turn with other modules' 2-rank scripts (launch_groups.py)
LAUNCH = torchrun_case("int8 at sp2 under torchrun", 2, _torchrun_argv, timeout=300)
BACKGROUND_JOBS = {"launched": LAUNCH.hooks}
launched = LAUNCH.fixture("launched")


@pytest.mark.launcher
@pytest.mark.slow
def test_sp2_int8_frames_are_the_same_bytes_on_mp_and_torchrun_and_within_2_of_one_rank(tiny_model, int8_gen, launched):
    """Sequence parallelism over int8 layers: the same layout gives the same bytes on mp and under torchrun (the
    external executor), within 2 of one rank's int8 frames (another layout), with the same weight report on every
    rank of both."""
    from launchers import format_output

    single = frames(int8_gen)
    with VideoGenerator.from_pretrained(tiny_model, executor="mp", quantize="int8", progress=False, **SP2) as gen:
        result = gen.generate(PROMPT, **REQUEST)
        reports = gen.collective_rpc(lambda w: w.weights)
    assert max_abs_diff(result.frames, single) <= 2
    assert reports[0] == reports[1] == result.weights and result.weights["transformer"]["quantized_modules"] > 0
    folder, proc = launched
    assert proc.returncode == 0, format_output(proc)
    assert np.array_equal(np.load(folder / "out" / "frames.npy"), result.frames), "torchrun's frames are not mp's"
    for rank in (0, 1):
        assert json.loads((folder / "out" / f"weights{rank}.json").read_text()) == result.weights


def test_every_family_runs_int8(tmp_path_factory):
    """Wan2.2 A14B (both experts) and HunyuanVideo 1.5 (both text encoders) with int8 weights and activations and
    int8 text encoders: frames on every run alike."""
    for model, request, quantized in [
        (
            family_checkpoint(tmp_path_factory, "wan22_t2v_a14b"),
            dict(REQUEST, num_inference_steps=4),
            ("transformer", "transformer_2", "text_encoder"),
        ),
        (
            hunyuan_checkpoint(tmp_path_factory),
            dict(REQUEST, height=48, width=80),
            ("transformer", "text_encoder", "text_encoder_2"),
        ),
    ]:
        with VideoGenerator.from_pretrained(
            model, executor="inline", quantize="int8", quantize_text_encoder="int8-weight", progress=False
        ) as gen:
            result = gen.generate(PROMPT, **request)
            assert np.array_equal(result.frames, gen.generate(PROMPT, **request).frames)
        assert sorted(result.weights) == sorted(quantized)
        assert all(result.weights[name]["quantized_modules"] > 0 for name in quantized), result.weights


# -- refused before anything loads ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--quantize", "fp8"], r"--quantize fp8 needs float8 matrix products.*the ranks run on cpu.*int8"),
        (["--quantize-text-encoder", "fp8"], r"--quantize-text-encoder fp8 needs float8"),
        (["--attention", "sage"], r"--attention sage needs a CUDA GPU and the sageattention package"),
        (["--attention", "flash", "--device", "cpu"], r"--attention flash needs a CUDA GPU and the flash_attn"),
    ],
)
def test_a_mode_this_device_cannot_run_exits_2_before_loading(argv, named, tmp_path, capsys, no_weights_loaded):
    out = tmp_path / "out"
    assert main(["generate", "--prompt", "x", "--output", str(out), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(named, err), err
    assert not out.exists()


def test_unknown_modes_exit_2_naming_the_flag(capsys):
    for flag, value in [("--quantize", "int4"), ("--attention", "xformers"), ("--quantize-text-encoder", "8")]:
        assert main(["generate", "--prompt", "x", flag, value]) == 2
        assert flag in capsys.readouterr().err


def test_fp8_is_accepted_on_a_gpu_that_has_float8_and_torchao_is_required():
    config = EngineConfig(quantize="fp8")
    check_support(config, DeviceKind("cuda", (9, 0)))
    with pytest.raises(ConfigError, match=r"quantize='fp8' with dtype='float32': .*bfloat16"):
        check_support(EngineConfig(quantize="fp8", dtype="float32"), DeviceKind("cuda", (9, 0)))
    with pytest.raises(ConfigError, match=r"quantize='fp8' needs float8.*compute capability 8.0"):
        check_support(config, DeviceKind("cuda", (8, 0)))
    with pytest.raises(ConfigError, match=r"quantize='int8' needs torchao.*distvideo\[quantize\]"):
        check_support(EngineConfig(quantize="int8"), DeviceKind("cpu"), has=lambda package: False)
    check_support(EngineConfig(quantize="fp8-weight"), DeviceKind("cpu"), has=lambda package: False)
    check_support(EngineConfig(attention="sage"), DeviceKind("cuda", (9, 0)), has=lambda package: True)
    with pytest.raises(ConfigError, match=r"attention='sage' with ring_size=2: ring attention"):
        check_support(EngineConfig(attention="sage", ring_size=2), DeviceKind("cuda", (9, 0)), has=lambda p: True)


def test_quantized_weights_do_not_combine_with_sharding():
    with pytest.raises(ConfigError, match=r"shard_weights='transformer' with quantize: .*aten.split"):
        EngineConfig(num_gpus=2, shard_weights="transformer", quantize="int8").validate()


def test_a_checkpoint_saved_quantized_is_refused_naming_the_model(tiny_model, tmp_path, capsys, no_weights_loaded):
    model = tmp_path / "quantized"
    shutil.copytree(tiny_model, model)
    config_file = model / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    assert main(["generate", "--model", str(model), "--prompt", "x", "--output", str(tmp_path / "o.mp4")]) == 2
    err = capsys.readouterr().err
    assert "saved quantized" in err and "'bitsandbytes'" in err and "--quantize" in err, err
