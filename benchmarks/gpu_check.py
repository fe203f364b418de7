"""The prepared GPU check: the one script to run when a CUDA GPU is lent for a few minutes (issue 19).

On one CUDA device, in phases, each with its own time budget (a phase that runs out of time is cut short or skipped,
and what was measured so far is written after every phase):

1. build: a random-weight checkpoint with Wan2.1-T2V-1.3B's transformer and VAE (30 layers, 12 heads x 128, ffn
   8960, text_dim 4096; VAE base_dim 96, z_dim 16; a 2-layer UMT5 of width 4096) and a small 256-wide one, no
   download (distvideo.testing.checkpoints; reused from --folder when already built with the same config);
2. table14b: the row of LightX2V's public table (Wan2.1-I2V-14B, 480 x 832, 81 frames, s/step on one H100): a
   checkpoint with the model's exact shapes drawn on the device, then distvideo, diffusers' WanImageToVideoPipeline
   and distvideo with its fast paths (together, then each alone), one engine at a time (gpu_check_table14b.py);
3. parity_diffusers: distvideo against diffusers' WanPipeline on the small checkpoint on CUDA: float32 frames within 2;
   bfloat16 frames no further from diffusers' float32 frames than twice diffusers' own bfloat16 frames are
   (gpu_check_phases, above BF16_MEAN_FACTOR, says why);
4. parity_executors: float32 frames of the inline and the mp executor, byte-identical;
5. bench: 480x832, 33 and 81 frames, 20 steps, guidance 5 on the 1.3B-shaped checkpoint, distvideo and diffusers
   interleaved run by run (`distvideo bench`'s loop: text encoding, denoising per step, decoding, end to end, peak
   memory, MFU against a measured bf16 matmul peak);
6. offload: one engine per `--offload` mode (none, text, model) on the 1.3B-shaped checkpoint, one request at the
   first timed shape (2 steps): device memory after loading, the request's peak, text-encoding and decoding times,
   frames byte-identical to offload=none (gpu_check_offload.py); skipped in --smoke mode;
7. quantize: one engine per `--quantize` mode and `--attention` kernel (and fp8 with sage together) at the first
   timed shape, 4 steps: per-step time and speedup against the unquantized engine, PSNR and max difference of the
   frames, the weight report (gpu_check_more.py); a setting the device cannot run is skipped with distvideo's
   refusal (in --smoke mode: fp8-weight runs, fp8 is refused on the CPU);
8. few_step: a step-distilled schedule (4 Euler steps, LightX2V's timesteps, no guidance: one branch) against the
   guided 50-step request on the 1.3B-shaped checkpoint at the first timed shape: denoising and end-to-end times and
   their ratio (gpu_check_few_step.py; in --smoke mode 8 guided steps);
9. compile: `distvideo bench --compile` (regional torch.compile of the transformer blocks) on the first timed shape:
   the compiling first run, warm runs beside the bench phase's uncompiled figures, frames against an uncompiled run;
   skipped in --smoke mode (compiling takes 20-35 s on 2 CPU cores; tests/test_compile.py covers it on CPU);
10. resume: the denoising checkpoints' cost per step (issue 54); skipped until they land.

The phases after table14b share what is left of the budget, in this order: a phase that does not fit is recorded as
skipped ("the run's time budget is spent").

Writes gpu_check.json and gpu_check.md into --out; exits 1 on any parity failure or phase error, 3 when the
whole-run watchdog fired (the partial results are written first), 2 on bad arguments. Never uses the network.

    python benchmarks/gpu_check.py --out gpu-check            # on the GPU machine, under 9 minutes
    python benchmarks/gpu_check.py --smoke --out /tmp/smoke   # CPU, tiny sizes, float32, mp on 2 gloo ranks
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any Hugging Face import: never the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PHASES = (
    *("build", "table14b", "parity_diffusers", "parity_executors", "bench", "layout_estimate", "caching"),
    *("quantize", "offload", "few_step", "compile", "resume"),
)
WATCHDOG_GRACE_S = 15.0


class Run:
    """The results so far, the clock, and the writer of the JSON and Markdown files (after every phase, and by the
    watchdog when the whole run outlives its budget)."""

    def __init__(self, out: Path, mode: str, budget: float):
        self.out, self.started = out, time.monotonic()
        self.deadline = self.started + budget
        self.lock = threading.Lock()
        self.current: str | None = None
        self.result: dict[str, Any] = {
            "mode": mode,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "commit": _commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget,
            "environment": _environment(),
            "phases": {},
            "ok": None,
            "complete": False,
            "elapsed_s": 0.0,
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)

    def record(self, name: str, value: dict[str, Any]) -> None:
        with self.lock:
            self.result["phases"][name] = value
            self.write()

    def write(self, final: bool = False) -> None:
        phases = self.result["phases"]
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        self.result["ok"] = all(p.get("status") in ("ok", "skipped") for p in phases.values()) if final else None
        # every phase ran in full (compile, and offload in --smoke mode, are skipped by design there; a phase whose
        # feature has not landed is not a gap)
        optional = {"compile", "offload"} if self.result["mode"] == "smoke" else {"compile"}
        self.result["complete"] = all(
            p.get("status") == "ok" or n in optional or p.get("not_landed") for n, p in phases.items()
        )
        _atomic(self.out / "gpu_check.json", json.dumps(self.result, indent=2, default=str) + "\n")
        _atomic(self.out / "gpu_check.md", markdown(self.result))


def _atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _environment() -> dict[str, Any]:
    import platform

    import diffusers
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus_visible": torch.cuda.device_count() if cuda else 0,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


# -- the Markdown table ---------------------------------------------------------------------------

FIGURES = [
    ("end to end (s)", lambda r: r["e2e_s"], "e2e_s"),
    ("text encoding (s)", lambda r: r["stages"]["text_encoding"], "text_encoding"),
    ("denoising (s)", lambda r: r["stages"]["denoising"], "denoising"),
    ("denoising per step (s)", lambda r: r["stages"]["denoising_per_step"], "denoising_per_step"),
    ("decoding (s)", lambda r: r["stages"]["decoding"], "decoding"),
    ("peak memory (MiB)", lambda r: r["peak_memory_mb"], "peak_memory_mb"),
    ("MFU (%)", lambda r: 100 * r["mfu"], None),
]


PARITY_KEYS = (
    "float32_vs_diffusers_float32",
    "bfloat16_vs_diffusers_float32",
    "diffusers_bfloat16_vs_diffusers_float32",
)


def _phase_line(name: str, phase: dict[str, Any]) -> str:
    detail = phase.get("reason") or phase.get("error") or ""
    if name == "parity_diffusers" and "bounds" in phase:
        f32, ours, floor = (phase[k] for k in PARITY_KEYS)
        bounds = phase["bounds"]
        detail = (
            f"{phase['device']}: float32 max {f32['max_abs_diff']} (<= {bounds['float32_max_abs_diff']}); bfloat16 "
            f"vs diffusers float32 mean {ours['mean_abs_diff']:.3f} (<= {bounds['bfloat16_mean_vs_float32']:.3f}), "
            f"max {ours['max_abs_diff']} (<= {bounds['bfloat16_max_vs_float32']}); diffusers' own bfloat16: mean "
            f"{floor['mean_abs_diff']:.3f}, max {floor['max_abs_diff']}"
        )
    if name == "parity_executors" and "mp" in phase:
        detail = "; ".join(
            f"mp {n} rank(s): {m['status']} ({m.get('check') or m.get('reason')}, max abs diff {m.get('max_abs_diff')})"
            for n, m in phase["mp"].items()
        )
    if name == "offload" and "modes" in phase:
        detail = "; ".join(
            f"{mode}: peak {m.get('request_peak_mb')} MiB, {m.get('frames_vs_none', 'reference')}"
            if m["status"] != "skipped"
            else f"{mode}: skipped"
            for mode, m in phase["modes"].items()
        )
    if name == "few_step" and "speedup_denoising" in phase:
        detail = f"{phase['shape']}: {phase['speedup_denoising']}x denoising, {phase['speedup_e2e']}x end to end"
    if name == "build" and "large" in phase:
        t = phase["large"]["transformer"]
        detail = (
            f"large: {t['num_layers']} layers, {t['num_attention_heads']} x {t['attention_head_dim']}, ffn "
            f"{t['ffn_dim']}, {phase['large']['gigabytes']} GB{' (reused)' if phase['large']['reused'] else ''}"
        )
    return f"| {name} | {phase.get('status')} | {phase.get('elapsed_s', '')} | {detail.replace('|', '/')} |"


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        f"# GPU check ({result['mode']})",
        "",
        f"`{result['command']}`, commit {result['commit']}, {result['date']}; {env.get('gpu') or 'CPU only'}, torch "
        f"{env['torch']}, diffusers {env['diffusers']}; {result['elapsed_s']} s of a {result['budget_s']} s budget; "
        f"ok: {result['ok']}, complete: {result['complete']}",
        "",
        "| phase | status | seconds | detail |",
        "| --- | --- | ---: | --- |",
    ]
    lines += [_phase_line(name, phase) for name, phase in result["phases"].items()]
    for key, shape in result["phases"].get("bench", {}).get("shapes", {}).items():
        lines += ["", f"## {key}, {result['phases']['bench'].get('steps')} steps, guidance 5", ""]
        if shape["status"] != "ok":
            lines.append(f"{shape['status']}: {shape.get('reason')}")
            continue
        report = shape["report"]
        ours, theirs, ratios = report["distvideo"], report["diffusers"], report["ratios"]
        runs = report["config"]["runs"]
        lines += [f"medians of {runs} run(s) after {report['config']['warmup']} warm-up, interleaved", ""]
        lines += ["| figure | distvideo | diffusers | ratio |", "| --- | ---: | ---: | ---: |"]
        for label, get, ratio in FIGURES:
            lines.append(
                f"| {label} | {get(ours):.3f} | {get(theirs):.3f} | {f'{ratios[ratio]:.3f}' if ratio else ''} |"
            )
        lines.append(
            f"\nframes max abs diff {report['check']['frames_max_abs_diff']} (uint8); matmul peak "
            f"{report['matmul_peak_flops'] / 1e12:.1f} TFLOP/s ({report['env']['matmul']['dtype']}); notes: "
            + ("; ".join(report["notes"]) or "none")
        )
    from gpu_check_more import markdown_lines as more_lines
    from gpu_check_offload import markdown_lines
    from gpu_check_table14b import markdown_lines as table_lines

    offload = markdown_lines(result["phases"].get("offload", {}))
    table = table_lines(result["phases"].get("table14b", {}))
    return "\n".join([*lines, *table, *more_lines(result), *offload, *_compile_lines(result)]) + "\n"


def _compile_lines(result: dict[str, Any]) -> list[str]:
    """The compile phase's figures beside the bench phase's uncompiled distvideo figures of the same shape."""
    phase = result["phases"].get("compile", {})
    if phase.get("status") != "ok":
        return []
    first, key = phase["first_run"], phase["shape"]
    lines = ["", f"## {key} with --compile, {phase['steps']} steps, guidance 5", ""]
    lines.append(
        f"first run {first['e2e_s']:.2f} s, of which torch.compile {first.get('compile_s', 0.0):.2f} s; frames "
        f"against the uncompiled engine: {phase['frames_vs_uncompiled']}"
    )
    report = phase.get("report")
    if report is None:
        return [*lines, "", "no warm run fit in the time left"]
    eager = result["phases"].get("bench", {}).get("shapes", {}).get(key, {}).get("report")
    lines += ["", "| figure | compiled (warm) | uncompiled (bench phase) |", "| --- | ---: | ---: |"]
    for label, get, _ in FIGURES:
        uncompiled = f"{get(eager['distvideo']):.3f}" if eager else ""
        lines.append(f"| {label} | {get(report['distvideo']):.3f} | {uncompiled} |")
    return lines


# -- running --------------------------------------------------------------------------------------


def run_phase(run: Run, name: str, budget: float, body: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    from gpu_check_phases import Guard

    guard = Guard(budget, run.deadline)
    if guard.left() < 1:
        value: dict[str, Any] = {"status": "skipped", "reason": "the run's time budget is spent"}
    else:
        run.current = name
        run.log(f"phase {name}: start (budget {guard.left():.0f} s)")
        began = time.monotonic()
        try:
            value = body(guard)
        except Exception as exc:
            value = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        value["elapsed_s"] = round(time.monotonic() - began, 1)
        if value["status"] == "ok" and value["elapsed_s"] > budget:
            value.setdefault("notes", []).append(f"over its budget of {budget:.0f} s")
    run.log(f"phase {name}: {value['status']} {value.get('error') or value.get('reason') or ''}".rstrip())
    run.record(name, value)
    _free_device()
    return value


def _free_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def start_watchdog(run: Run, grace: float) -> threading.Timer:
    """When the run outlives its budget by `grace` (a phase stuck in a collective, a run far over its estimate):
    record that, write what there is, and leave with exit code 3."""

    def fire() -> None:
        with run.lock:
            run.result["watchdog"] = f"fired in phase {run.current} after {run.elapsed():.0f} s"
            if run.current is not None and run.current not in run.result["phases"]:
                run.result["phases"][run.current] = {"status": "timed_out", "reason": run.result["watchdog"]}
        run.log(f"watchdog: {run.result['watchdog']}; writing partial results")
        with run.lock:
            run.write(final=True)
        os._exit(3)

    timer = threading.Timer(max(0.0, run.deadline - time.monotonic()) + grace, fire)
    timer.daemon = True
    timer.start()
    return timer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md (created)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, float32 (the test suite runs this)")
    parser.add_argument("--folder", help="where the checkpoints are built (default: a temp folder per mode)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (default 540 on GPU, 400 smoke)")
    parser.add_argument("--phases", help=f"comma-separated subset of {','.join(PHASES)} (build is always run)")
    parser.add_argument("--break-parity", action="store_true", help=argparse.SUPPRESS)  # tests: perturb one output
    args = parser.parse_args(argv)
    chosen = set(args.phases.split(",")) if args.phases else set(PHASES)
    if chosen - set(PHASES):
        parser.error(f"--phases {args.phases}: unknown {sorted(chosen - set(PHASES))}; choose from {PHASES}")
    args.chosen = chosen | {"build"}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import gpu_check_more as more
    import gpu_check_phases as ph
    import torch
    from gpu_check_table14b import resume_phase, table14b_phase

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run with --smoke on CPU", file=sys.stderr)
        return 2
    sizes = ph.SMOKE if args.smoke else ph.GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(args.folder or Path(tempfile.gettempdir()) / f"distvideo-gpu-check-{sizes.mode}")
    run = Run(out, sizes.mode, args.budget or (400.0 if args.smoke else 540.0))
    run.log(f"gpu check ({sizes.mode}) on {run.result['environment']['gpu'] or 'CPU'}; writing {out}")
    start_watchdog(run, WATCHDOG_GRACE_S)
    budgets = sizes.budgets
    built = run_phase(run, "build", budgets["build"], lambda g: ph.build(sizes, folder, g))
    if built["status"] != "ok":
        run.write(final=True)
        return 1
    small, large = built["small"]["path"], built["large"]["path"]
    if "table14b" in args.chosen:
        run_phase(run, "table14b", budgets["table14b"], lambda g: table14b_phase(sizes, folder, g, run.log))
    if "parity_diffusers" in args.chosen:
        body = lambda g: ph.parity_diffusers(sizes, small, g, args.break_parity)  # noqa: E731
        run_phase(run, "parity_diffusers", budgets["parity_diffusers"], body)
    if "parity_executors" in args.chosen:
        body = lambda g: ph.parity_executors(sizes, small, g, args.break_parity)  # noqa: E731
        run_phase(run, "parity_executors", budgets["parity_executors"], body)
    if "bench" in args.chosen:
        body = lambda g: {**ph.bench(sizes, large, g, run.log), "steps": sizes.steps}  # noqa: E731
        run_phase(run, "bench", budgets["bench"], body)
    if "layout_estimate" in args.chosen:  # arithmetic on the bench phase's figures: no device time
        body = lambda g: more.layout_estimate_phase(run.result, sizes, large)  # noqa: E731
        run_phase(run, "layout_estimate", budgets["layout_estimate"], body)
    if "caching" in args.chosen:
        run_phase(run, "caching", budgets["caching"], lambda g: more.caching_phase(sizes, large, g, run.log))
    if "quantize" in args.chosen:
        run_phase(run, "quantize", budgets["quantize"], lambda g: more.quantize_phase(sizes, large, g, run.log))
    if "offload" in args.chosen:
        from gpu_check_offload import offload_phase

        run_phase(run, "offload", budgets["offload"], lambda g: offload_phase(sizes, large, g, run.log))
    if "few_step" in args.chosen:
        from gpu_check_few_step import few_step_phase

        run_phase(run, "few_step", budgets["few_step"], lambda g: few_step_phase(sizes, large, g, run.log))
    if "compile" in args.chosen:
        run_phase(run, "compile", budgets["compile"], lambda g: ph.compile_phase(sizes, large, g, run.log))
    if "resume" in args.chosen:
        run_phase(run, "resume", budgets["resume"], lambda g: resume_phase(sizes, large, g, run.log))
    with run.lock:
        run.write(final=True)
    run.log(f"done: ok={run.result['ok']}; wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0 if run.result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
