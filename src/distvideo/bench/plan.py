"""The bench's command line and its plan: every argument checked against the model before any weight loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distvideo.cli.arguments import add_engine_arguments, add_request_arguments, configs_from_args
from distvideo.engine import ResolvedEngine
from distvideo.errors import ConfigError
from distvideo.paths import check_output_target
from distvideo.request import ResolvedRequest

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
    add_engine_arguments(bench)
    add_request_arguments(bench, defaults={"prompt": DEFAULT_PROMPT, "seed": 0})
    bench.add_argument("--compare", choices=["diffusers"], help="also run this reference, interleaved (one rank)")
    bench.add_argument("--runs", type=int, default=3, help="measured runs of each side (default 3)")
    bench.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each side first (default 1)")
    bench.add_argument("--json", dest="json_path", metavar="OUT", help="write the full report as JSON to this file")
    bench.add_argument(
        "--matmul-size", dest="matmul_size", type=int, help="n of the n^3 matmul peak (default 1024 on CPU, 8192 GPU)"
    )


@dataclass
class BenchPlan:
    engine: ResolvedEngine
    request: ResolvedRequest
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
        return self.request.num_inference_steps * (2 if self.request.guidance_scale > 1.0 else 1)

    @property
    def model_flops(self) -> int:
        return self.flops_per_forward * self.transformer_forwards


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    """Check every argument against the model's JSON files; raises ConfigError (exit 2) before any loading."""
    from distvideo.executors import resolve_engine

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
    engine, given = configs_from_args(args)
    if engine.lora and args.compare == "diffusers":
        raise ConfigError("--lora with --compare diffusers: the diffusers side would run without the adapter; drop one")
    # one bar per run instead of the per-step bar; bad paths and impossible layouts fail here, before any process
    resolved = resolve_engine(dataclasses.replace(engine, progress=False))
    if json_path is not None and resolved.launch is None:  # (launched ranks: rank 0 writes it, the others never)
        check_output_target(json_path, name="--json")
    info = resolved.model
    request = info.resolve_request(dataclasses.replace(given, save_video=False, return_frames=True))
    try:
        tr_config = json.loads((info.path / "transformer" / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model {info.path}: cannot read transformer/config.json ({exc})") from None
    latent_shape = info.latent_shape(request)
    # the transformer's input: the noise latents, with the condition channels of Wan2.1 I2V / Wan2.2 I2V-A14B
    input_shape = (*latent_shape[:1], int(tr_config.get("in_channels", latent_shape[1])), *latent_shape[2:])
    if info.family.transformer_flops is None:
        raise ConfigError(f"--model {info.path}: {info.family.name} declares no FLOP count; the bench needs one")
    try:
        breakdown = info.family.transformer_flops(info, request, input_shape)
    except ValueError as exc:
        raise ConfigError(f"--model {info.path}: {exc}") from None
    return BenchPlan(
        engine=resolved,
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
