"""`distvideo bench`: per-stage timings, peak memory and MFU of distvideo, side by side with diffusers.

Every rank runs the command (SPMD under a launcher); rank 0 prints the table and writes the JSON. With
`--compare diffusers` on one rank, diffusers' WanPipeline runs in a child process (so peak memory is its own) on
the same checkpoint, shape, seed, device, dtypes and thread count, interleaved with distvideo run by run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distvideo.config import ConfigError, EngineConfig, GenerationRequest

logger = logging.getLogger("distvideo.cli")

DEFAULT_PROMPT = "a red fox running through snow"
STAGES = ("text_encoding", "denoising", "denoising_per_step", "decoding")
#: figures compared run by run as distvideo / diffusers (lower is better for each)
RATIO_FIGURES = ("e2e_s", *STAGES, "peak_memory_mb")
MATMUL_SECONDS = 0.5


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure distvideo (and diffusers) on a checkpoint",
        description="Per-stage timings, peak memory and model FLOP utilisation of distvideo on one checkpoint and "
        "shape; with --compare diffusers, diffusers' WanPipeline on the same inputs, interleaved run by run.",
    )
    from distvideo.cli.main import add_engine_arguments

    add_engine_arguments(bench)
    bench.add_argument("--compare", choices=["diffusers"], help="also run this reference, interleaved (one rank)")
    bench.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt (default {DEFAULT_PROMPT!r})")
    bench.add_argument("--negative-prompt", dest="negative_prompt", help="negative prompt (default: empty)")
    bench.add_argument("--num-frames", dest="num_frames", type=int, help="frames, of the form 4k+1")
    bench.add_argument("--height", type=int, help="pixels, a multiple of the model's spatial stride")
    bench.add_argument("--width", type=int, help="pixels, a multiple of the model's spatial stride")
    bench.add_argument("--steps", dest="num_inference_steps", type=int, help="denoising steps")
    bench.add_argument("--guidance-scale", dest="guidance_scale", type=float, help="CFG scale (<= 1 turns it off)")
    bench.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    bench.add_argument("--runs", type=int, default=3, help="measured runs of each side (default 3)")
    bench.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each side first (default 1)")
    bench.add_argument("--json", dest="json_path", metavar="OUT", help="write the full report as JSON to this file")
    bench.add_argument(
        "--matmul-size", dest="matmul_size", type=int, help="n of the n^3 matmul peak (default 1024 on CPU, 8192 GPU)"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR")


# -- the plan: everything checked before any weight is loaded ------------------------------------


@dataclass
class BenchPlan:
    engine: EngineConfig
    request: GenerationRequest  # resolved against the model: every field set
    runs: int
    warmup: int
    compare: str | None
    json_path: Path | None
    matmul_size: int | None
    latent_shape: tuple[int, int, int, int, int]
    flops_per_forward: int
    flops_breakdown: dict[str, int]

    @property
    def transformer_forwards(self) -> int:
        """Forwards per request: one per step, two with classifier-free guidance (as both pipelines decide)."""
        assert self.request.num_inference_steps is not None and self.request.guidance_scale is not None
        return self.request.num_inference_steps * (2 if self.request.guidance_scale > 1.0 else 1)

    @property
    def model_flops(self) -> int:
        return self.flops_per_forward * self.transformer_forwards


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    """Check every argument against the model's JSON files; raises ConfigError (exit 2) before any loading."""
    from distvideo.cli.main import configs_from_args
    from distvideo.generator import embedded_model_path
    from distvideo.models.flops import wan_transformer_flops_breakdown
    from distvideo.models.registry import probe_model

    if args.runs < 1:
        raise ConfigError(f"--runs {args.runs}: must be >= 1 (measured runs of each side), e.g. --runs 5")
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup}: must be >= 0 (unmeasured runs first), e.g. --warmup 1")
    if args.matmul_size is not None and args.matmul_size < 16:
        raise ConfigError(f"--matmul-size {args.matmul_size}: must be >= 16, e.g. 1024 on CPU or 8192 on a GPU")
    json_path = Path(args.json_path).expanduser() if args.json_path else None
    if json_path is not None:
        if json_path.is_dir():
            raise ConfigError(
                f"--json {args.json_path}: is a folder; pass a file name, e.g. {json_path / 'bench.json'}"
            )
        if not json_path.parent.is_dir():
            raise ConfigError(f"--json {args.json_path}: folder {json_path.parent} does not exist; create it first")
    engine, request = configs_from_args(args)
    if engine.lora and args.compare == "diffusers":
        raise ConfigError("--lora with --compare diffusers: the diffusers side would run without the adapter; drop one")
    if engine.model is None:
        engine = dataclasses.replace(engine, model=str(embedded_model_path()))
    info = probe_model(str(engine.model))
    request = info.resolve_request(dataclasses.replace(request, save_video=False, return_frames=True))
    try:
        tr_config = json.loads((info.path / "transformer" / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model {engine.model}: cannot read transformer/config.json ({exc})") from None
    assert request.num_frames is not None and request.height is not None and request.width is not None
    latent_shape = (
        1,
        int(tr_config.get("in_channels", 16)),
        (request.num_frames - 1) // info.vae_scale_temporal + 1,
        request.height // info.vae_scale_spatial,
        request.width // info.vae_scale_spatial,
    )
    try:
        breakdown = wan_transformer_flops_breakdown(tr_config, latent_shape, request.max_sequence_length)
    except ValueError as exc:
        raise ConfigError(f"--model {engine.model}: {exc}") from None
    return BenchPlan(
        engine=engine,
        request=request,
        runs=args.runs,
        warmup=args.warmup,
        compare=args.compare,
        json_path=json_path,
        matmul_size=args.matmul_size,
        latent_shape=latent_shape,
        flops_per_forward=sum(breakdown.values()),
        flops_breakdown=breakdown,
    )


# -- measurements that run on every rank (sent through collective_rpc) and in the diffusers process --


def reset_peak_memory(device: Any) -> str:
    """Start a new peak-memory window; returns the name of the metric :func:`read_peak_memory_mb` will report."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda max_memory_allocated"
    try:  # Linux >= 4.0: "5" resets the resident-set high-water mark (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "peak RSS of the run (VmHWM after reset)"
    except OSError:
        return "peak RSS of the process lifetime (VmHWM, no reset possible)"


def read_peak_memory_mb(device: Any) -> float:
    """Peak memory since :func:`reset_peak_memory`, in MiB: CUDA max allocated, or the process's peak RSS on CPU."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def measure_matmul_flops(device: Any, dtype: Any, size: int, seconds: float = MATMUL_SECONDS) -> float:
    """Dense matmul FLOP/s of this process on `device`: the best of five windows of size^3 matmuls filling
    `seconds`, at the current torch thread count."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    gen = torch.Generator("cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device, dtype)
    b = torch.randn(size, size, generator=gen).to(device, dtype)
    c = torch.empty(size, size, device=device, dtype=dtype)
    torch.matmul(a, b, out=c)  # first call: library initialisation
    sync()
    start = time.perf_counter()
    torch.matmul(a, b, out=c)
    sync()
    one = max(time.perf_counter() - start, 1e-9)
    windows = 5
    reps = max(1, int(seconds / windows / one))
    best = 0.0
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        sync()
        best = max(best, 2 * size**3 * reps / (time.perf_counter() - start))
    return best


def default_matmul_size(device: Any) -> int:
    return 8192 if device.type == "cuda" else 1024


def _rank_reset_peak_memory(worker: Any) -> str:
    return reset_peak_memory(worker.device)


def _rank_peak_memory_mb(worker: Any) -> float:
    return read_peak_memory_mb(worker.device)


def _rank_transformer_dtype(worker: Any) -> Any:
    from distvideo.worker import component_dtypes

    return component_dtypes(worker.device, worker.config.dtype)["transformer"]


def _rank_matmul_flops(worker: Any, size: int | None) -> float:
    return measure_matmul_flops(
        worker.device, _rank_transformer_dtype(worker), size or default_matmul_size(worker.device)
    )


def _rank_environment(worker: Any) -> dict[str, Any]:
    import torch

    from distvideo.worker import component_dtypes

    dtypes = component_dtypes(worker.device, worker.config.dtype)
    return {
        "rank": worker.rank,
        "device": str(worker.device),
        "device_name": device_name(worker.device),
        "threads": torch.get_num_threads(),
        "dtypes": {name: str(dtype).removeprefix("torch.") for name, dtype in dtypes.items()},
    }


def device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- diffusers, in a child process ---------------------------------------------------------------


@dataclass
class DiffusersSpec:
    model: str
    device: str
    dtypes: dict[str, str]  # component -> torch dtype name, as the distvideo rank uses
    threads: int


class _DiffusersTimer:
    """diffusers' WanPipeline with its stages timed by wrapping its components (it has no timings of its own):
    text encoding = `pipe.encode_prompt`; denoising = from the first transformer forward (a forward pre-hook) to
    the start of `pipe.vae.decode` (the loop with its scheduler steps, and the latent unscaling after it);
    decoding = `pipe.vae.decode`."""

    def __init__(self, spec: DiffusersSpec):
        import warnings

        import diffusers
        import torch
        import transformers
        from diffusers import AutoencoderKLWan, WanPipeline

        for library in (diffusers, transformers):
            library.utils.logging.set_verbosity_error()
            library.utils.logging.disable_progress_bar()
        self.device = torch.device(spec.device)
        dtypes = {name: getattr(torch, value) for name, value in spec.dtypes.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch_dtype -> dtype rename; older diffusers need it
            vae = AutoencoderKLWan.from_pretrained(spec.model, subfolder="vae", torch_dtype=dtypes["vae"])
            pipe = WanPipeline.from_pretrained(spec.model, vae=vae, torch_dtype=dtypes["transformer"])
        pipe.text_encoder.to(dtypes["text_encoder"])
        pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe
        self.marks: dict[str, float] = {}
        self.forwards = 0
        self._wrap(pipe, "encode_prompt", "text_encoding")
        self._wrap(pipe.vae, "decode", "decoding")
        pipe.transformer.register_forward_pre_hook(self._on_transformer_forward)

    def _now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _wrap(self, owner: Any, attr: str, stage: str) -> None:
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.marks[f"{stage}_start"] = self._now()
            out = original(*args, **kwargs)
            self.marks[f"{stage}_end"] = self._now()
            return out

        object.__setattr__(owner, attr, timed)  # an instance attribute shadows the method (nn.Module too)

    def _on_transformer_forward(self, module: Any, args: Any) -> None:
        self.forwards += 1
        if "denoising_start" not in self.marks:
            self.marks["denoising_start"] = self._now()

    def run(self, request: GenerationRequest, return_frames: bool) -> dict[str, Any]:
        import numpy as np
        import torch

        self.marks, self.forwards = {}, 0
        metric = reset_peak_memory(self.device)
        start = self._now()
        video = self.pipe(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            num_frames=request.num_frames,
            height=request.height,
            width=request.width,
            num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(request.seed),
            output_type="np",
            max_sequence_length=request.max_sequence_length,
        ).frames[0]
        e2e = self._now() - start
        m = self.marks
        stages = {
            "text_encoding": m["text_encoding_end"] - m["text_encoding_start"],
            "denoising": m["decoding_start"] - m["denoising_start"],
            "decoding": m["decoding_end"] - m["decoding_start"],
        }
        stages["denoising_per_step"] = stages["denoising"] / max(1, request.num_inference_steps or 1)
        out: dict[str, Any] = {
            "e2e_s": e2e,
            "stages": stages,
            "peak_memory_mb": read_peak_memory_mb(self.device),
            "memory_metric": metric,
            "transformer_forwards": self.forwards,
        }
        if return_frames:
            out["frames"] = np.round(np.asarray(video) * 255).astype(np.uint8)
        return out


def _diffusers_process(conn: Any) -> None:
    """Entry point of the child process: import the libraries (while the parent loads distvideo), then take
    ("load", spec), say ready, and answer ("run", request, frames?) until ("close",) or the parent goes away."""
    try:
        import diffusers  # noqa: F401  (the slow imports, before the spec arrives)
        import torch

        message = conn.recv()
        if message[0] != "load":
            return
        spec = message[1]
        torch.set_num_threads(spec.threads)
        timer = _DiffusersTimer(spec)
        conn.send(("ready", {"threads": torch.get_num_threads()}))
        while True:
            message = conn.recv()
            if message[0] == "close":
                return
            _, request, return_frames = message
            conn.send(("ok", timer.run(request, return_frames)))
    except BaseException as exc:  # report, then exit: the parent raises it
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except Exception:
            pass
    finally:
        conn.close()


class DiffusersBaseline:
    """A diffusers WanPipeline in a spawned process, run on demand; its memory peak is its own. The process starts
    (and imports torch and diffusers) at construction; `load` gives it the checkpoint, device and threads."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_diffusers_process, args=(child_conn,), daemon=True, name="diffusers")
        self._proc.start()
        child_conn.close()
        self.loaded = False

    def load(self, spec: DiffusersSpec) -> None:
        self._conn.send(("load", spec))
        self._receive("loading")
        self.loaded = True

    def _receive(self, what: str) -> Any:
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"the diffusers process died while {what} (exit code {self._proc.exitcode})")
        try:
            message = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the diffusers process closed its pipe while {what}") from None
        if message[0] == "error":
            logger.debug("diffusers process traceback:\n%s", message[2])
            raise RuntimeError(f"diffusers baseline failed while {what}: {message[1]}")
        return message[1]

    def run(self, request: GenerationRequest, return_frames: bool = False) -> dict[str, Any]:
        self._conn.send(("run", request, return_frames))
        return self._receive("generating")

    def close(self) -> None:
        if self._conn.closed:
            return
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except OSError:
                pass
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()


# -- the benchmark loop --------------------------------------------------------------------------


def distvideo_run(gen: Any, request: GenerationRequest) -> tuple[dict[str, Any], Any]:
    """One measured distvideo request on every rank: e2e wall time, stage timings, peak memory of every rank."""
    metrics = gen.collective_rpc(_rank_reset_peak_memory)
    start = time.perf_counter()
    result = gen.generate_request(request)
    e2e = time.perf_counter() - start
    peaks = gen.collective_rpc(_rank_peak_memory_mb)
    t = result.timings
    record = {
        "e2e_s": e2e,
        "stages": {
            "text_encoding": t["text_encoding"],
            "denoising": t["denoising"],
            "denoising_per_step": t["per_step_denoising"],
            "decoding": t["decoding"],
        },
        "peak_memory_mb": max(peaks),
        "peak_memory_mb_per_rank": peaks,
        "memory_metric": metrics[0],
    }
    return record, result.frames


def add_efficiency(record: dict[str, Any], model_flops: int, peak_flops: float) -> None:
    """Achieved transformer FLOP/s over the denoising stage, and MFU against the measured matmul peak."""
    achieved = model_flops / record["stages"]["denoising"]
    record["achieved_flops"] = achieved
    record["mfu"] = achieved / peak_flops


def figure(record: Mapping[str, Any], name: str) -> float:
    return float(record["stages"][name] if name in STAGES else record[name])


def median_record(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "e2e_s": statistics.median(r["e2e_s"] for r in records),
        "stages": {s: statistics.median(r["stages"][s] for r in records) for s in STAGES},
        "peak_memory_mb": statistics.median(r["peak_memory_mb"] for r in records),
    }
    for key in ("achieved_flops", "mfu"):
        if all(key in r for r in records):
            out[key] = statistics.median(r[key] for r in records)
    if all("peak_memory_mb_per_rank" in r for r in records):
        ranks = len(records[0]["peak_memory_mb_per_rank"])
        out["peak_memory_mb_per_rank"] = [
            statistics.median(r["peak_memory_mb_per_rank"][i] for r in records) for i in range(ranks)
        ]
    return out


def run_ratios(ours: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, float]:
    return {name: figure(ours, name) / figure(reference, name) for name in RATIO_FIGURES}


@contextmanager
def _quiet_generator_log(level: str | None) -> Iterator[None]:
    """The generator logs one info line per request; across many runs it would break the progress bar."""
    gen_logger = logging.getLogger("distvideo.generator")
    previous = gen_logger.level
    if not (level and level.upper() == "DEBUG"):
        gen_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        gen_logger.setLevel(previous)


def cmd_bench(args: argparse.Namespace) -> int:
    from distvideo import envs
    from distvideo.generator import VideoGenerator
    from distvideo.launch import launcher_rank_present, read_launch_environ

    plan = plan_from_args(args)  # bad input exits 2 here, before any process or weight
    envs.set_external({"DISTVIDEO_NO_PROGRESS": "1"})  # the per-step bar would fight the per-run bar
    if args.log_level:  # VideoGenerator.from_config re-applies the environment's level; make it this one
        envs.set_external({"DISTVIDEO_LOG_LEVEL": args.log_level})
    # the diffusers process imports its libraries while distvideo loads, when one rank is expected
    one_rank = (plan.engine.num_gpus or 1) == 1 and not launcher_rank_present(read_launch_environ())
    baseline = DiffusersBaseline() if plan.compare == "diffusers" and one_rank else None
    try:
        with _quiet_generator_log(args.log_level), VideoGenerator.from_config(plan.engine) as gen:
            request = gen.model_info.resolve_request(plan.request)
            show_progress = gen.is_output_rank and not args.no_progress and sys.stderr.isatty()
            report = run_bench(gen, plan, request, show_progress, baseline)
    finally:
        if baseline is not None:
            baseline.close()
    if report is not None:
        print(format_report(report), flush=True)
        if plan.json_path is not None:
            write_json(plan.json_path, report)
            print(f"wrote {plan.json_path}", flush=True)
    return 0


def run_bench(
    gen: Any,
    plan: BenchPlan,
    request: GenerationRequest,
    show_progress: bool,
    started: DiffusersBaseline | None = None,
) -> dict[str, Any] | None:
    """Warm-up then measured runs, distvideo then diffusers in each; the report on the output rank, else None.
    `started` is a diffusers process already started (not loaded); closed here if the comparison cannot run."""
    from tqdm.auto import tqdm

    rank_envs = gen.collective_rpc(_rank_environment)
    notes: list[str] = []
    baseline: DiffusersBaseline | None = None
    if plan.compare == "diffusers":
        if gen.world_size > 1:
            notes.append(
                f"diffusers comparison skipped: distvideo runs on {gen.world_size} ranks and diffusers' WanPipeline "
                "has no matching multi-process layout here; run on one rank (no launcher, --num-gpus 1) to compare"
            )
        else:
            first = rank_envs[0]
            baseline = started or DiffusersBaseline()
            baseline.load(DiffusersSpec(str(plan.engine.model), first["device"], first["dtypes"], first["threads"]))
    if started is not None and baseline is not started:
        started.close()
    try:
        runs: list[dict[str, Any]] = []
        frames_diff: int | None = None
        forwards_noted = False
        total = plan.warmup + plan.runs
        with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not show_progress) as bar:
            for i in range(total):
                measured = i >= plan.warmup
                peak_per_rank = gen.collective_rpc(_rank_matmul_flops, args=(plan.matmul_size,)) if measured else []
                ours, frames = distvideo_run(gen, request)
                reference = None
                if baseline is not None:
                    reference = baseline.run(request, return_frames=frames_diff is None)
                    theirs = reference.pop("frames", None)
                    if reference["transformer_forwards"] != plan.transformer_forwards and not forwards_noted:
                        forwards_noted = True
                        notes.append(
                            f"diffusers ran {reference['transformer_forwards']} transformer forwards per request, "
                            f"the FLOP count assumes {plan.transformer_forwards}: its MFU is off by that factor"
                        )
                    if theirs is not None and frames is not None:
                        frames_diff = max_abs_diff(frames, theirs)
                bar.update()
                logger.debug(
                    "%s %d: distvideo %.2f s%s",
                    "run" if measured else "warm-up",
                    i - plan.warmup if measured else i,
                    ours["e2e_s"],
                    f", diffusers {reference['e2e_s']:.2f} s" if reference is not None else "",
                )
                if not measured:
                    continue
                peak = sum(peak_per_rank)
                add_efficiency(ours, plan.model_flops, peak)
                record: dict[str, Any] = {"index": len(runs), "matmul_flops_per_rank": peak_per_rank, "distvideo": ours}
                if reference is not None:
                    add_efficiency(reference, plan.model_flops, peak_per_rank[0])
                    record["diffusers"] = reference
                    record["ratios"] = run_ratios(ours, reference)
                runs.append(record)
    finally:
        if baseline is not None:
            baseline.close()
    if not gen.is_output_rank:
        return None
    return build_report(gen, plan, request, runs, rank_envs, frames_diff, notes)


def max_abs_diff(a: Any, b: Any) -> int:
    import numpy as np

    if a.shape != b.shape:
        raise RuntimeError(f"distvideo and diffusers made frames of different shapes: {a.shape} vs {b.shape}")
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def build_report(
    gen: Any,
    plan: BenchPlan,
    request: GenerationRequest,
    runs: list[dict[str, Any]],
    rank_envs: list[dict[str, Any]],
    frames_diff: int | None,
    notes: list[str],
) -> dict[str, Any]:
    ours = median_record([r["distvideo"] for r in runs])
    compared = [r for r in runs if "diffusers" in r]
    theirs = median_record([r["diffusers"] for r in compared]) if compared else None
    ratios = ratios_range = None
    if compared:
        ratios = {name: statistics.median(r["ratios"][name] for r in compared) for name in RATIO_FIGURES}
        ratios_range = {
            name: [min(r["ratios"][name] for r in compared), max(r["ratios"][name] for r in compared)]
            for name in RATIO_FIGURES
        }
    matmul_peak = statistics.median(sum(r["matmul_flops_per_rank"]) for r in runs)
    return {
        "distvideo": ours,
        "diffusers": theirs,
        "ratio_e2e": ratios["e2e_s"] if ratios else None,
        "ratios": ratios,
        "ratios_range": ratios_range,
        "config": {
            "model": str(plan.engine.model),
            "prompt": request.prompt,
            "negative_prompt": request.negative_prompt,
            "num_frames": request.num_frames,
            "height": request.height,
            "width": request.width,
            "steps": request.num_inference_steps,
            "guidance_scale": request.guidance_scale,
            "seed": request.seed,
            "runs": plan.runs,
            "warmup": plan.warmup,
            "compare": plan.compare,
            "latent_shape": list(plan.latent_shape),
            "text_len": request.max_sequence_length,
            "transformer_forwards": plan.transformer_forwards,
            "transformer_flops_per_forward": plan.flops_per_forward,
            "transformer_flops_breakdown": plan.flops_breakdown,
        },
        "matmul_peak_flops": matmul_peak,
        "check": {"frames_max_abs_diff": frames_diff},
        "env": environment(gen, plan, rank_envs, runs),
        "notes": notes,
        "runs": runs,
    }


def environment(gen: Any, plan: BenchPlan, rank_envs: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict:
    import diffusers
    import torch
    import transformers

    first = rank_envs[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": device_name(torch.device("cpu")),
        "cores": cores,
        "device": first["device"],
        "device_name": first["device_name"],
        "dtypes": first["dtypes"],
        "threads": first["threads"],
        "threads_per_rank": [e["threads"] for e in rank_envs],
        "world_size": gen.world_size,
        "executor": gen.config.executor,
        "sp_size": gen.config.sp_size,
        "cfg_parallel": gen.config.cfg_parallel,
        "memory_metric": runs[0]["distvideo"]["memory_metric"] if runs else None,
        "matmul": {
            "size": plan.matmul_size or default_matmul_size(torch.device(first["device"])),
            "dtype": first["dtypes"]["transformer"],
            "seconds": MATMUL_SECONDS,
            "statistic": "best of 5 windows, measured before every run on every rank at once",
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)


# -- the table -----------------------------------------------------------------------------------


def _seconds(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.2f}"


def _flops(value: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} FLOP"


def format_report(report: Mapping[str, Any]) -> str:
    ours, theirs, ratios = report["distvideo"], report["diffusers"], report["ratios"] or {}
    cfg, env = report["config"], report["env"]
    rows: list[tuple[str, Callable[[Mapping[str, Any]], str], str | None]] = [
        ("end to end (s)", lambda r: _seconds(r["e2e_s"]), "e2e_s"),
        ("  text encoding (s)", lambda r: _seconds(r["stages"]["text_encoding"]), "text_encoding"),
        ("  denoising (s)", lambda r: _seconds(r["stages"]["denoising"]), "denoising"),
        ("    per step (s)", lambda r: _seconds(r["stages"]["denoising_per_step"]), "denoising_per_step"),
        ("  decoding (s)", lambda r: _seconds(r["stages"]["decoding"]), "decoding"),
        ("peak memory (MiB)", lambda r: f"{r['peak_memory_mb']:.0f}", "peak_memory_mb"),
        ("transformer (FLOP/s)", lambda r: _flops(r["achieved_flops"]) + "/s", None),
        ("MFU", lambda r: f"{100 * r['mfu']:.1f}%", None),
    ]
    width = 22
    lines = [
        f"distvideo bench  {cfg['model']}",
        f"  {cfg['num_frames']} frames x {cfg['height']}x{cfg['width']}, {cfg['steps']} steps, guidance "
        f"{cfg['guidance_scale']}, seed {cfg['seed']}; latents {'x'.join(map(str, cfg['latent_shape'][1:]))}; "
        f"{cfg['transformer_forwards']} transformer forwards of {_flops(cfg['transformer_flops_per_forward'])}",
        f"  medians of {cfg['runs']} runs (+{cfg['warmup']} warm-up)"
        + (
            "; interleaved, ratio = median over runs of distvideo / diffusers (< 1: distvideo better)" if theirs else ""
        ),
        "",
        f"{'':{width}}{'distvideo':>14}{'diffusers' if theirs else '':>14}{'ratio' if theirs else '':>9}"
        f"{'(min-max)' if theirs else '':>14}",
    ]
    for label, show, key in rows:
        line = f"{label:{width}}{show(ours):>14}"
        if theirs:
            line += f"{show(theirs):>14}"
            if key:
                low, high = report["ratios_range"][key]
                line += f"{ratios[key]:>9.3f}{f'{low:.2f}-{high:.2f}':>14}"
        lines.append(line)
    check = report["check"]["frames_max_abs_diff"]
    mem_ranks = ours.get("peak_memory_mb_per_rank") or []
    lines += [
        "",
        f"matmul peak {_flops(report['matmul_peak_flops'])}/s ({env['matmul']['dtype']} "
        f"{env['matmul']['size']}^3, {env['threads']} thread(s) per rank); MFU = transformer FLOP/s / matmul peak",
        f"memory: {env['memory_metric']}"
        + (f"; per rank {', '.join(f'{m:.0f}' for m in mem_ranks)} MiB" if len(mem_ranks) > 1 else ""),
    ]
    if check is not None:
        lines.append(f"frames: max |distvideo - diffusers| = {check} (uint8)")
    lines.append(
        f"env: torch {env['torch']}, diffusers {env['diffusers']}, {env['device']} ({env['device_name']}), "
        f"{env['cores']} cores, world size {env['world_size']} ({env['executor']}), {env['date']}"
    )
    lines += [f"note: {note}" for note in report["notes"]]
    if theirs is None and cfg["compare"] is None:
        lines.append("(add --compare diffusers for the reference column)")
    return "\n".join(line.rstrip() for line in lines)
