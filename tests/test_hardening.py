"""Issue 14's hardening, each promise with a test that fails without it: request bounds and a memory estimate that
refuse what cannot fit before any work, output paths checked before work (dangling symlinks, NUL, long names), frames
kept when writing fails, non-finite and rank-0 LoRA adapters refused, a bounded adapter cache, pickle weights refused
unless allowed, readable names for any prompt, files that honour the umask, and the bench JSON never written through a
planted symlink."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import distvideo.media
import distvideo.worker
from distvideo import ConfigError, LoraError, VideoGenerator, VideoWriteError
from distvideo.bench import write_json
from distvideo.cli.main import main
from distvideo.executors import resolve_engine
from distvideo.media import write_video
from distvideo.models.embedded import tiny_model_path
from distvideo.models.memory import estimate_request
from distvideo.paths import resolve_output_path, sanitize_prompt
from distvideo.request import GenerationRequest
from distvideo.testing.checkpoints import build_test_checkpoint
from distvideo.testing.lora_files import build_random_lora, random_lora_layers, save_lora_file

from background import BackgroundJob, run_program

SMALL = dict(num_frames=5, height=32, width=48, num_inference_steps=1)
SMALL_FLAGS = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "1"]


@pytest.fixture
def no_loading(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("model weights were loaded for a request that should have been refused")

    monkeypatch.setattr(distvideo.worker, "load_components", tripwire)


# --- request bounds --------------------------------------------------------------------------------------------------
BOUNDS = [
    ({"num_inference_steps": 1001}, "num_inference_steps"),
    ({"prompt": "a" * 20_001}, "prompt"),
    ({"negative_prompt": "a" * 20_001}, "negative_prompt"),
    ({"max_sequence_length": 1025}, "max_sequence_length"),
    ({"fps": 241}, "fps"),
    ({"height": 8193}, "height"),
    ({"num_frames": 4098}, "num_frames"),  # request.MAX_FRAMES + 1
    ({"output_path": "out/a\x00b.mp4"}, "NUL"),
    ({"output_path": "out/" + "x" * 300 + ".mp4"}, "names are limited to 255"),
]


@pytest.mark.parametrize(("fields", "named"), BOUNDS, ids=[n for _, n in BOUNDS])
def test_out_of_bounds_requests_are_refused_naming_the_field(fields, named):
    with pytest.raises(ConfigError, match=named):
        GenerationRequest(**{"prompt": "ok", **fields}).validate()


@pytest.mark.parametrize("flags", [["--steps", "1000000000"], ["--fps", "100000"], ["--log-level", "FOO"]])
def test_the_cli_refuses_them_with_exit_2_before_loading(flags, no_loading, tmp_path, capsys):
    assert main(["generate", "--prompt", "x", "--output", str(tmp_path), *flags]) == 2
    assert list(tmp_path.iterdir()) == []
    assert "error" in capsys.readouterr().err


# --- memory ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("executor", ["inline", "mp"])
def test_a_request_that_cannot_fit_is_refused_before_any_step(executor):
    kwargs = {"num_gpus": 2} if executor == "mp" else {}
    steps: list[int] = []
    with VideoGenerator.from_pretrained(executor=executor, **kwargs) as gen:
        with pytest.raises(ConfigError) as info:
            gen.generate(
                "x", num_frames=4097, height=8192, width=8192, num_inference_steps=1, save_video=False,
                on_progress=lambda d, t: steps.append(d),
            )  # fmt: skip
        text = str(info.value)
        assert "needs about" in text and "GiB" in text and "this rank can use" in text and "It would fit at" in text
        assert steps == [], "a denoising step ran before the refusal"
        assert gen.generate("x", save_video=False, **SMALL).frames is not None  # still usable


MEASURE = r"""
import json, sys
from distvideo import VideoGenerator
from distvideo.request import GenerationRequest
from distvideo.models.memory import estimate_request

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:"))

model, t, h, w = sys.argv[1], *map(int, sys.argv[2:])
with VideoGenerator.from_pretrained(model, executor="inline") as gen:
    gen.generate("warm up", num_frames=5, height=32, width=32, num_inference_steps=1, save_video=False)
    # one step: the estimate does not depend on the step count, and the peak is the decode's (a step's working set is
    # a fraction of it at these sizes; a second step repeats the first's)
    request = gen.model_info.resolve_request(GenerationRequest(prompt="a fox", num_frames=t, height=h, width=w,
                                                               num_inference_steps=1, save_video=False))
    before = rss_mb()
    peak = gen.generate_request(request).peak_memory_mb
    estimate = estimate_request(gen.model_info, request).total / 2**20
print(json.dumps({"measured_mb": peak - before, "estimate_mb": estimate}))
"""


ESTIMATED = {"base16": ("benchmark", (21, 256, 320)), "base4": ("embedded", (9, 768, 768))}
BUILD_BENCHMARK = (
    "import sys; from distvideo.testing.checkpoints import build_benchmark_checkpoint as b; b(sys.argv[1])"
)


def _measure_peaks(stopping: threading.Event, environ: dict[str, str]) -> dict[str, subprocess.CompletedProcess[str]]:
    """MEASURE for each decoder, each in a fresh process; the benchmark checkpoint built in one of its own."""
    tmp = Path(tempfile.mkdtemp(prefix="distvideo-memory-estimate-"))
    try:
        build = run_program([sys.executable, "-c", BUILD_BENCHMARK, str(tmp / "ckpt")], stopping, 300, env=environ)
        assert build.returncode == 0, build.stderr
        models = {"benchmark": str(tmp / "ckpt"), "embedded": str(tiny_model_path())}
        # glibc's malloc raises its mmap threshold as mmapped blocks are freed, so whether the decode's large tensors
        # come from mmap (returned at free) or from the heap (kept) followed the process's allocation history: the
        # same request's peak varied from 396 to 523 MiB (estimate 352). A fixed threshold makes the peak the memory
        # the request holds: 299.5 to 300.3 MiB in five runs
        fixed = {**environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        return {
            key: run_program([sys.executable, "-c", MEASURE, models[which], *map(str, size)], stopping, 600, env=fixed)
            for key, (which, size) in ESTIMATED.items()
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# two fresh processes of about 10 s each whose figures are all the test checks: in the background (background.py;
# the peak is the kernel's high-water mark of the process, VmHWM, whatever else the machine runs)
PEAKS = BackgroundJob("memory estimate against measured peaks", _measure_peaks)
BACKGROUND_JOBS = {"measured_peaks": PEAKS.hooks}


@pytest.fixture
def measured_peaks() -> dict[str, subprocess.CompletedProcess[str]]:
    return PEAKS.result()


@pytest.mark.slow
@pytest.mark.parametrize("key", list(ESTIMATED))
def test_the_estimate_is_within_30_percent_of_the_measured_peak(key, measured_peaks):
    """Measured in a fresh process (the allocator keeps what earlier requests freed): the peak resident memory the
    request added, against the estimate, for two decoders of different width at sizes where the activations
    dominate (hundreds of MiB)."""
    proc = measured_peaks[key]
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    print("FIGURE memory estimate", *ESTIMATED[key], figures)
    assert abs(figures["estimate_mb"] - figures["measured_mb"]) <= 0.3 * figures["measured_mb"], figures


def test_the_estimate_follows_the_layout(test_checkpoint):
    model = resolve_engine(distvideo.config.EngineConfig(model=str(test_checkpoint))).model
    request = model.resolve_request(GenerationRequest(prompt="x", num_frames=17, height=256, width=256))
    one = estimate_request(model, request)
    two = estimate_request(model, request, sp_size=2, decode_bands=2, output_rank=False)
    assert two.decode_bytes == one.decode_bytes // 2 and two.video_bytes == 0
    assert two.transformer_bytes < one.transformer_bytes


# --- output paths ----------------------------------------------------------------------------------------------------
FRAMES = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)


def test_a_dangling_symlink_counts_as_taken(tmp_path):
    target = tmp_path / "v.mp4"
    target.symlink_to(tmp_path / "nowhere")
    assert resolve_output_path(str(target), "p", 0) == tmp_path / "v_1.mp4"
    code = f"from distvideo.media import write_video; import numpy as np; print(write_video(np.zeros((1,16,16,3), np.uint8), {str(target)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "v_1.mp4")  # the old writer spun here forever
    assert os.readlink(target) == str(tmp_path / "nowhere")


def test_an_output_under_a_file_is_refused_before_loading(tmp_path, no_loading, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert (
        main(["generate", "--prompt", "x", "--executor", "inline", "--output", str(blocker / "v.mp4"), *SMALL_FLAGS])
        == 2
    )
    assert "is not a folder" in capsys.readouterr().err


def test_frames_are_kept_when_writing_fails(tmp_path, monkeypatch):
    def disk_full(frames, file, fps):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(distvideo.media, "_encode_mp4", disk_full)
    with VideoGenerator.from_pretrained(executor="inline") as gen:
        with pytest.raises(VideoWriteError) as info:
            gen.generate("x", output_path=str(tmp_path / "v.mp4"), **SMALL)
        expected = gen.generate("x", save_video=False, **SMALL).frames
    assert "No space left on device" in str(info.value) and str(info.value.frames_path) in str(info.value)
    assert np.array_equal(np.load(info.value.frames_path), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.frames.npy"]


def test_non_ascii_prompts_give_readable_distinct_names():
    assert sanitize_prompt("Кошка на лодке").startswith("koshka_na_lodke_")
    assert sanitize_prompt("日本の猫").startswith("riben")
    assert sanitize_prompt("Ça va") != sanitize_prompt("Ca va")  # the hash keeps them apart
    assert sanitize_prompt("A Cat, on a Boat!") == "a_cat_on_a_boat"  # plain ASCII unchanged


def test_written_files_honour_the_umask(tmp_path):
    code = (
        "import os, numpy as np; from distvideo.media import write_video; os.umask(0o027); "
        f"print(oct(os.stat(write_video(np.zeros((1,16,16,3), np.uint8), {str(tmp_path / 'v.mp4')!r})).st_mode & 0o777))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "0o640", proc.stderr


def test_bench_json_never_writes_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "bench.json"
    out.symlink_to(victim)
    write_json(out, {"ok": 1})
    assert victim.read_text() == "precious" and not out.is_symlink()
    assert json.loads(out.read_text()) == {"ok": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "victim.txt"]


def test_write_video_is_unchanged_by_the_checks(tmp_path):
    assert write_video(FRAMES, tmp_path / "a.mp4").read_bytes() == write_video(FRAMES, tmp_path / "b.mp4").read_bytes()


# --- LoRA values and the adapter cache -------------------------------------------------------------------------------
def _lora(tmp_path: Path, name: str, **changes) -> tuple[Path, str]:
    """A valid adapter file with one change; returns its path and the key (for "rank0": the layer) the change hit."""
    layers = random_lora_layers(tiny_model_path(), rank=2, seed=3)
    path = save_lora_file(tmp_path / f"{name}.safetensors", layers, alpha=2.0)
    tensors = load_file(path)
    matrix = next(k for k in sorted(tensors) if k.endswith("lora_B.weight"))
    changed = matrix
    if "poison" in changes:
        tensors[matrix] = tensors[matrix].clone()
        tensors[matrix].view(-1)[0] = changes["poison"]
    if "alpha" in changes:
        changed = sorted(k for k in tensors if k.endswith("alpha"))[-1]  # another layer than the matrix's
        tensors[changed] = torch.tensor(changes["alpha"])
    if changes.get("rank0"):  # one layer of rank 0, the others intact
        changed = matrix.removeprefix("transformer.").removesuffix(".lora_B.weight")
        down, up = f"transformer.{changed}.lora_A.weight", matrix
        tensors[down], tensors[up] = tensors[down][:0], tensors[up][:, :0]
    save_file(tensors, path)
    return path, changed


@pytest.fixture(scope="module")
def lora_gen():
    with VideoGenerator.from_pretrained(executor="inline") as gen:
        yield gen


@pytest.mark.parametrize(
    ("change", "named"),
    [({"poison": float("nan")}, "NaN or infinite"), ({"poison": float("inf")}, "NaN or infinite"),
     ({"alpha": float("inf")}, "NaN or infinite"), ({"rank0": True}, "rank of at least 1")],
    ids=["nan", "inf", "alpha-inf", "rank0"],
)  # fmt: skip
def test_broken_adapters_are_refused_naming_the_key(lora_gen, tmp_path, change, named):
    path, key = _lora(tmp_path, "broken", **change)
    with pytest.raises(LoraError, match=named) as info:
        lora_gen.set_lora_adapter("broken", str(path))
    assert f"{key} " in str(info.value), f"the error does not name {key}: {info.value}"
    assert lora_gen.collective_rpc(lambda w: w.lora["transformer"].describe() if w.lora else None)[0] in (
        None,
        {"active": [], "merged": True, "separate": False, "cached": [], "touched_layers": 0},
    )


def test_the_adapter_cache_is_bounded_and_adapters_can_be_removed(tmp_path):
    a, b = (
        build_random_lora(tiny_model_path(), tmp_path / "a.safetensors", seed=1),
        build_random_lora(tiny_model_path(), tmp_path / "b.safetensors", seed=2),
    )
    config = distvideo.config.EngineConfig(executor="inline", lora_cache_mb=0)  # only the active adapters stay
    with VideoGenerator.from_config(config) as gen:
        gen.set_lora_adapter("a", str(a))
        gen.set_lora_adapter("b", str(b))  # replaces a: a is no longer active, and the cache has no room for it
        state = gen.collective_rpc(lambda w: w.lora["transformer"].describe())[0]
        assert state["cached"] == ["b"] and state["active"] == [["b", 1.0]]
        with pytest.raises(LoraError, match="no LoRA adapter named 'a'"):
            gen.set_lora_adapter("a")
    with VideoGenerator.from_pretrained(executor="inline") as gen:
        gen.set_lora_adapter("a", str(a))
        gen.set_lora_adapter("b", str(b))
        with pytest.raises(LoraError, match="is active"):
            gen.remove_lora_adapter("b")
        gen.remove_lora_adapter("a")
        assert gen.collective_rpc(lambda w: w.lora["transformer"].describe())[0]["cached"] == ["b"]
        with pytest.raises(LoraError, match="no such adapter"):
            gen.remove_lora_adapter("a")


# --- pickle weights --------------------------------------------------------------------------------------------------
def test_pickle_only_weights_are_refused_unless_allowed(tmp_path, no_loading, capsys):
    ckpt = build_test_checkpoint(tmp_path / "ckpt")
    folder = ckpt / "transformer"
    weights = next(folder.glob("*.safetensors"))
    torch.save(load_file(weights), folder / "diffusion_pytorch_model.bin")
    weights.unlink()
    assert main(["generate", "--prompt", "x", "--model", str(ckpt), "--executor", "inline", *SMALL_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "only pickle weights" in err and "diffusion_pytorch_model.bin" in err and "safe_serialization=True" in err


def test_pickle_weights_load_when_the_user_allows_them(tmp_path):
    ckpt = build_test_checkpoint(tmp_path / "ckpt")
    folder = ckpt / "transformer"
    weights = next(folder.glob("*.safetensors"))
    torch.save(load_file(weights), folder / "diffusion_pytorch_model.bin")
    reference = tmp_path / "reference"
    shutil.copytree(ckpt, reference)
    weights.unlink()
    with VideoGenerator.from_config(
        distvideo.config.EngineConfig(model=str(ckpt), executor="inline", allow_pickle_weights=True)
    ) as gen:
        frames = gen.generate("x", save_video=False, **SMALL).frames
    (reference / "transformer" / "diffusion_pytorch_model.bin").unlink()
    with VideoGenerator.from_pretrained(reference, executor="inline") as gen:
        assert np.array_equal(frames, gen.generate("x", save_video=False, **SMALL).frames)
