"""`distvideo bench`: per-stage timings, peak memory and MFU of distvideo, side by side with diffusers.

Every rank runs the command (SPMD under a launcher); rank 0 prints the table and writes the JSON. With
`--compare diffusers` on one rank, diffusers' WanPipeline runs in a child process (so peak memory is its own) on
the same checkpoint, shape, seed, device, dtypes and thread count, interleaved with distvideo run by run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from distvideo.bench.baseline import DiffusersBaseline, DiffusersSpec
from distvideo.bench.measure import (
    add_efficiency,
    distvideo_run,
    max_abs_diff,
    rank_environment,
    rank_matmul_flops,
    run_ratios,
)
from distvideo.bench.plan import BenchPlan
from distvideo.bench.report import build_report, format_report, write_json
from distvideo.request import ResolvedRequest

if TYPE_CHECKING:
    from distvideo.protocols import GeneratorHandle

logger = logging.getLogger("distvideo.cli")


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


def cmd_bench(args: argparse.Namespace, plan: BenchPlan) -> int:
    """Run the checked `plan` (`plan_from_args(args)`)."""
    from distvideo.generator import VideoGenerator

    engine = plan.engine
    # the diffusers process imports its libraries while distvideo loads, when one rank is expected
    baseline = DiffusersBaseline() if plan.compare == "diffusers" and engine.world_size == 1 else None
    try:
        with _quiet_generator_log(engine.config.log_level), VideoGenerator.from_engine(engine) as gen:
            show_progress = gen.is_output_rank and args.progress is not False and sys.stderr.isatty()
            report = run_bench(gen, plan, plan.request, show_progress, baseline)
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
    gen: GeneratorHandle,
    plan: BenchPlan,
    request: ResolvedRequest,
    show_progress: bool,
    started: DiffusersBaseline | None = None,
) -> dict[str, Any] | None:
    """Warm-up then measured runs, distvideo then diffusers in each; the report on the output rank, else None.
    `started` is a diffusers process already started (not loaded); closed here if the comparison cannot run."""
    from tqdm.auto import tqdm

    rank_envs = gen.collective_rpc(rank_environment)
    notes: list[str] = []
    baseline = load_baseline(gen, plan, request, rank_envs, notes, started)
    try:
        total = plan.warmup + plan.runs
        with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not show_progress) as bar:
            runs, frames_diff = measure_interleaved(gen, plan, request, baseline, notes, on_run=bar.update)
    finally:
        if baseline is not None:
            baseline.close()
    if not gen.is_output_rank:
        return None
    return build_report(gen, plan, request, runs, rank_envs, frames_diff, notes)


def load_baseline(
    gen: GeneratorHandle,
    plan: BenchPlan,
    request: ResolvedRequest,
    rank_envs: list[dict[str, Any]],
    notes: list[str],
    started: DiffusersBaseline | None = None,
) -> DiffusersBaseline | None:
    """diffusers' pipeline loaded on the first rank's device, dtypes and threads when the plan compares with it
    and one rank runs (else a note says why not, and `started` is closed); None without a comparison."""
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
            pipeline = "WanImageToVideoPipeline" if request.image is not None else "WanPipeline"
            if plan.engine.model.class_name.startswith("HunyuanVideo15"):  # its own class is its reference
                pipeline = plan.engine.model.class_name
            baseline.load(
                DiffusersSpec(
                    str(plan.engine.config.model), first["device"], first["dtypes"], first["threads"], pipeline
                )
            )
    if started is not None and baseline is not started:
        started.close()
    return baseline


def measure_interleaved(
    gen: GeneratorHandle,
    plan: BenchPlan,
    request: ResolvedRequest,
    baseline: DiffusersBaseline | None,
    notes: list[str],
    on_run: Callable[[], Any] | None = None,
    stop: Callable[[float | None], bool] | None = None,
) -> tuple[list[dict[str, Any]], int | None]:
    """`plan.warmup` unmeasured then `plan.runs` measured runs, distvideo then `baseline` (if any) in each: the
    measured run records and the frames' max abs difference of the first pair. `stop`, given the seconds the
    previous run (both sides) took (None before the first), ends the loop early when it returns True."""
    runs: list[dict[str, Any]] = []
    frames_diff: int | None = None
    forwards_noted = False
    last: float | None = None
    for i in range(plan.warmup + plan.runs):
        if stop is not None and stop(last):
            notes.append(f"stopped after {i} of {plan.warmup + plan.runs} runs (warm-up included): out of time")
            break
        began = time.perf_counter()
        measured = i >= plan.warmup
        peak_per_rank = gen.collective_rpc(rank_matmul_flops, args=(plan.matmul_size,)) if measured else []
        ours, frames = distvideo_run(gen, request)
        if ours.get("compile_s"):
            what = f"run {i - plan.warmup}" if measured else f"warm-up {i}"
            notes.append(f"{what}: torch.compile took {ours['compile_s']:.2f} s of its denoising (not per step)")
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
        last = time.perf_counter() - began
        if on_run is not None:
            on_run()
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
    return runs, frames_diff
