"""benchmarks/gpu_check.py, the prepared GPU check, run as a developer runs it but with --smoke (CPU, tiny sizes,
float32, mp on two gloo ranks), once, so it cannot rot between the rare occasions a GPU is lent: its JSON fields and
its Markdown. Its failures are injected at the phase level in-process (the phases' models stubbed): a broken parity
and a phase that raises each turn into exit 1 with the results written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from background import BackgroundJob, run_program

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
STAGES = {"text_encoding", "denoising", "denoising_per_step", "decoding"}


def _smoke_run(
    stopping: threading.Event, environ: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], dict, str]:
    """The smoke run, in a folder of its own: the process, its JSON report and its Markdown."""
    tmp = Path(tempfile.mkdtemp(prefix="distvideo-gpu-check-"))
    try:
        out = tmp / "out"
        cmd = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--folder", str(tmp / "ckpt")]
        proc = run_program(cmd, stopping, 300, env={**environ, "HF_HUB_OFFLINE": "1"})
        report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").is_file() else {}
        md = (out / "gpu_check.md").read_text() if (out / "gpu_check.md").is_file() else ""
        return proc, report, md
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# about 20 s of a program whose outcome is all the test checks: it runs in the background (background.py)
SMOKE_RUN = BackgroundJob("gpu_check --smoke", _smoke_run)
BACKGROUND_JOBS = {"smoke_run": SMOKE_RUN.hooks}


@pytest.fixture
def smoke_run() -> tuple[subprocess.CompletedProcess[str], dict, str]:
    return SMOKE_RUN.result()


def _check_bench(bench: dict) -> None:
    assert bench["status"] == "ok" and set(bench["shapes"]) == {"5x32x48", "9x32x48"}
    for key, shape in bench["shapes"].items():
        assert shape["status"] == "ok", (key, shape)
        report = shape["report"]
        frames, height, width = (int(n) for n in key.split("x"))
        cfg = report["config"]
        assert (cfg["num_frames"], cfg["height"], cfg["width"], cfg["steps"], cfg["guidance_scale"]) == (
            frames, height, width, 2, 5.0,
        )  # fmt: skip
        for side in ("distvideo", "diffusers"):
            figures = report[side]
            assert set(figures["stages"]) == STAGES and figures["e2e_s"] > 0 and figures["peak_memory_mb"] > 0
            assert 0 < figures["mfu"] and figures["achieved_flops"] > 0
        assert report["matmul_peak_flops"] > 0 and set(report["ratios"]) >= {"e2e_s", "denoising", "decoding"}
        assert report["check"]["frames_max_abs_diff"] <= 2  # float32 on CPU: the project's rule against diffusers
        assert report["env"]["device"] == "cpu" and report["env"]["world_size"] == 1


def _check_table14b(table: dict) -> None:
    """The 14B row's code on the tiny build: distvideo and diffusers' WanImageToVideoPipeline ran the same I2V
    request (float32 frames within 2: in fact equal here), their per-step figures and ratio; the fast paths that the
    CPU refuses (fp8, sage) or smoke mode skips (compile) are recorded as such, with the reason."""
    assert table["status"] == "ok" and table["shape"] == "5x32x48" and table["steps"] == 2
    assert table["dtypes"]["transformer"] == "float32" and table["distvideo_vs_diffusers"]["max_abs_diff"] <= 2
    runs = table["runs"]
    assert list(runs) == [
        "distvideo", "diffusers", "distvideo, every fast path", "distvideo --compile", "distvideo --quantize fp8",
        "distvideo --attention sage",
    ]  # fmt: skip
    for label in ("distvideo", "diffusers"):
        run = runs[label]
        assert run["status"] == "ok" and run["denoising_per_step_s"] > 0 and 0 < run["mfu"], run
    assert runs["diffusers"]["per_step_vs_diffusers"] == 1.0 and runs["distvideo"]["per_step_vs_diffusers"] > 0
    assert "needs float8 matrix products" in runs["distvideo --quantize fp8"]["reason"]
    assert "sage" in runs["distvideo --attention sage"]["reason"]
    assert all(runs[k]["status"] == "skipped" for k in ("distvideo, every fast path", "distvideo --compile"))


@pytest.mark.slow
def test_smoke_run_writes_every_phase(smoke_run):
    proc, report, md = smoke_run
    assert proc.returncode == 0 and md, proc.stdout + proc.stderr
    assert report["mode"] == "smoke" and report["ok"] is True and report["elapsed_s"] > 0
    phases = report["phases"]
    assert list(phases) == [
        "build", "table14b", "parity_diffusers", "parity_executors", "bench", "layout_estimate", "caching", "quantize",
        "offload", "few_step", "compile", "resume",
    ]  # fmt: skip
    _check_table14b(phases["table14b"])
    resume = phases["resume"]  # issue 54 has not landed: skipped, saying so, and not a gap in `complete`
    assert resume["status"] == "skipped" and resume["not_landed"] and "issue 54" in resume["reason"]
    assert all("elapsed_s" in p for p in phases.values())
    few = phases[
        "few_step"
    ]  # the distilled schedule's 4 steps in one branch against 8 guided ones (figures, not bounds)
    assert few["status"] == "ok" and set(few["runs"]) == {"4 steps, no guidance", "8 steps, guided"}, few
    assert few["speedup_denoising"] > 0 and few["schedule"]["timesteps"] == [1000, 750, 500, 250]
    assert "| few_step | ok |" in md

    large = phases["build"]["large"]
    # the smoke run shrinks Wan2.1-T2V-1.3B's builder; what is left of its shape: 16 latent channels, z_dim 16
    assert large["transformer"]["in_channels"] == 16 and large["vae"]["z_dim"] == 16
    assert large["transformer"]["num_layers"] == 2 and not large["reused"]

    parity = phases["parity_diffusers"]
    assert parity["status"] == "ok" and parity["checks"] == dict.fromkeys(
        ("float32", "bfloat16_mean", "bfloat16_max"), True
    )
    f32, bf16 = parity["float32_vs_diffusers_float32"], parity["bfloat16_vs_diffusers_float32"]
    assert f32["max_abs_diff"] <= parity["bounds"]["float32_max_abs_diff"] == 2 and f32["shape"] == [5, 32, 32, 3]
    assert bf16["mean_abs_diff"] <= parity["bounds"]["bfloat16_mean_vs_float32"]
    assert parity["diffusers_bfloat16_vs_diffusers_float32"]["max_abs_diff"] > 0  # bfloat16 really ran

    executors = phases["parity_executors"]
    assert executors["status"] == "ok"
    assert executors["mp"]["1"] == {
        "status": "ok", "check": "byte-identical", "shape": [5, 32, 32, 3], "max_abs_diff": 0, "mean_abs_diff": 0.0,
    }  # fmt: skip
    assert executors["mp"]["2"]["status"] == "ok" and executors["mp"]["2"]["max_abs_diff"] <= 2

    _check_bench(phases["bench"])
    estimate = phases["layout_estimate"]
    assert estimate["status"] == "ok" and set(estimate["shapes"]) == {"5x32x48", "9x32x48"}
    for key, shape in estimate["shapes"].items():
        measured = phases["bench"]["shapes"][key]["report"]["distvideo"]["stages"]["denoising_per_step"]
        assert shape["measured_step_s"] == pytest.approx(measured, rel=1e-3) and shape["estimated_step_s"] > 0
        assert shape["estimate_over_measured"] == pytest.approx(shape["estimated_step_s"] / measured, rel=1e-3)
    caching = phases["caching"]
    # 5 steps: a step cache is refused below that (the run's other phases: 2)
    assert caching["status"] == "ok" and caching["shape"] == "5x32x48" and caching["steps"] == 5
    assert len(caching["calibration"]["ratios"]) == 5  # MagCache's ratios, one per step, calibrated in the phase
    assert list(caching["runs"]) == ["none", "first-block", "first-block 0.1", "mag"]
    for label, run in caching["runs"].items():
        method = label.split()[0]
        assert run["cache"] is None if method == "none" else run["cache"]["method"] == method
        if method != "none":  # the warm-up step is never skipped; nothing skipped: the uncached frames exactly
            skipped = run["cache"]["skipped_steps"]
            assert run["status"] == "ok" and all(1 <= step < 5 for step in skipped) and run["speedup_denoising"] > 0
            assert (run["psnr_db"] == float("inf")) == (run["vs_uncached"]["max_abs_diff"] == 0) == (not skipped)
    quantize = phases["quantize"]  # fp8-weight runs on the CPU and reports its layers; fp8 shows distvideo's refusal
    assert quantize["status"] == "ok" and list(quantize["runs"]) == ["none", "quantize fp8-weight", "quantize fp8"]
    stored = quantize["runs"]["quantize fp8-weight"]
    assert stored["status"] == "ok" and stored["weights"]["transformer"]["quantized_modules"] > 0
    assert stored["speedup_denoising"] > 0 and stored["vs_unquantized"]["max_abs_diff"] is not None
    fp8 = quantize["runs"]["quantize fp8"]
    assert fp8["status"] == "skipped" and "needs float8 matrix products" in fp8["reason"]
    assert phases["compile"]["status"] == "skipped" and "smoke mode" in phases["compile"]["reason"]
    assert phases["offload"]["status"] == "skipped" and "smoke mode" in phases["offload"]["reason"]
    assert report["complete"] is True

    for line in (
        "| parity_diffusers | ok |", "| parity_executors | ok |", "| offload | skipped |", "## 9x32x48",
        "## step caching, 5x32x48, 5 steps", "## Wan2.1-I2V-14B shapes, 5x32x48, 2 steps", "| distvideo | ", "| 9x32x48 | ", "## low precision, 5x32x48, 4 steps", "| quantize fp8-weight | ",
    ):  # fmt: skip
        assert line in md
    assert "phase bench: ok" in proc.stdout and "[" in proc.stdout.splitlines()[0]  # progress with elapsed time


def _stub_phases(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """gpu_check's phases with their models stubbed out: the build, and the frames of distvideo, diffusers and the
    executors (all equal), so the checks, the exit code and the files can be driven at the phase level in-process.
    The smoke run above runs the same phases for real. The whole-run watchdog is left out: it would `os._exit` the
    test process 400 s later."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check
    import gpu_check_phases as ph

    frames = np.arange(5 * 32 * 32 * 3, dtype=np.int64).reshape(5, 32, 32, 3).astype(np.uint8)
    shape = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8, "ffn_dim": 32}
    built = {"status": "ok", "small": {"path": "small"}, "large": {"path": "large", "transformer": shape}}
    built["large"].update(gigabytes=0.0, reused=False)
    monkeypatch.setattr(ph, "build", lambda sizes, folder, guard: built)
    env = {"device": "cpu", "dtypes": {}}
    monkeypatch.setattr(ph, "_distvideo_frames", lambda small, sizes, dtype: (None, {"frames": frames, "env": env}))
    monkeypatch.setattr(ph, "_diffusers_frames", lambda plan, env, dtypes: dict.fromkeys(dtypes, frames))
    monkeypatch.setattr(ph, "_frames", lambda small, sizes, executor, ranks: frames.copy())
    monkeypatch.setattr(gpu_check, "start_watchdog", lambda run, grace: None)
    return gpu_check, ph


def _main(gpu_check: Any, out: Path, *extra: str) -> tuple[int, dict]:
    code = gpu_check.main(["--smoke", "--out", str(out), "--phases", "parity_diffusers,parity_executors", *extra])
    return code, json.loads((out / "gpu_check.json").read_text())


def test_broken_parity_exits_nonzero(tmp_path, monkeypatch):
    """The hidden --break-parity moves one pixel of distvideo's frames by 128 levels in both parity checks: each
    must fail, the run must exit 1, and the results must still be written. Without it the same frames pass."""
    gpu_check, _ = _stub_phases(monkeypatch)
    code, report = _main(gpu_check, tmp_path / "good")
    assert code == 0 and report["ok"] is True
    assert report["phases"]["parity_executors"]["mp"]["1"]["check"] == "byte-identical"

    code, report = _main(gpu_check, tmp_path / "broken", "--break-parity")
    assert code == 1 and report["ok"] is False
    parity = report["phases"]["parity_diffusers"]
    assert parity["status"] == "failed" and parity["checks"]["float32"] is False
    assert parity["float32_vs_diffusers_float32"]["max_abs_diff"] == 128
    executors = report["phases"]["parity_executors"]
    assert executors["status"] == "failed" and executors["mp"]["1"]["status"] == "failed"
    assert executors["mp"]["2"]["status"] == "failed" and executors["mp"]["2"]["max_abs_diff"] == 128
    assert set(report["phases"]) == {"build", "parity_diffusers", "parity_executors"}
    assert "| parity_diffusers | failed |" in (tmp_path / "broken" / "gpu_check.md").read_text()


def test_a_phase_that_raises_is_an_error_and_the_run_goes_on(tmp_path, monkeypatch):
    """A phase whose body raises is recorded as an error with its traceback, the next phase still runs, and the run
    exits 1 with both written."""
    gpu_check, ph = _stub_phases(monkeypatch)

    def broken(small, sizes, dtype):
        raise RuntimeError("injected in _distvideo_frames")

    monkeypatch.setattr(ph, "_distvideo_frames", broken)
    code, report = _main(gpu_check, tmp_path / "out")
    assert code == 1 and report["ok"] is False and report["complete"] is False
    phase = report["phases"]["parity_diffusers"]
    assert phase["status"] == "error" and phase["error"] == "RuntimeError: injected in _distvideo_frames"
    assert "broken" in phase["traceback"]
    assert report["phases"]["parity_executors"]["status"] == "ok"
    assert "| parity_diffusers | error |" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_offload_phase_measures_every_mode(monkeypatch):
    """The offload phase runs only on CUDA in the GPU check; forced here on the CPU with the tiny model so its code
    cannot rot: every mode measured, frames byte-identical to offload=none, the Markdown table written."""
    import dataclasses
    import time

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpu_check_offload import markdown_lines, offload_phase
    from gpu_check_phases import SMOKE, Guard

    sizes = dataclasses.replace(SMOKE, shapes=[{"num_frames": 5, "height": 32, "width": 32, "warmup": 0, "runs": 1}])
    guard = Guard(300, time.monotonic() + 300)
    assert offload_phase(sizes, None, guard, print)["status"] == "skipped"  # smoke mode: skipped unless forced
    phase = offload_phase(sizes, None, guard, print, force=True)
    assert phase["status"] == "ok" and list(phase["modes"]) == ["none", "text", "model"]
    for mode, entry in phase["modes"].items():
        assert entry["status"] == "ok" and entry["request_peak_mb"] > 0 and entry["text_encoding_s"] >= 0, mode
        assert entry["resident_after_load_mb"] is None  # device memory: CUDA only
    assert phase["modes"]["none"]["offloaded_weights_mb"] == {}
    assert set(phase["modes"]["text"]["offloaded_weights_mb"]) == {"text_encoder"}
    assert set(phase["modes"]["model"]["offloaded_weights_mb"]) == {"text_encoder", "vae"}
    assert phase["modes"]["model"]["saving_ok"] is None  # no device memory to compare on the CPU
    assert phase["modes"]["text"]["frames_vs_none"] == phase["modes"]["model"]["frames_vs_none"] == "byte-identical"
    table = "\n".join(markdown_lines(phase))
    assert "## --offload on 5x32x32, 2 steps" in table and "| model |" in table
