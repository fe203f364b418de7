"""Parallel denoising and decode on the benchmark checkpoint, one thread per rank.

Modes, each in its own process group (one launch per mode, each rank one process with one intra-op thread):

- ``single``: one rank (inline executor);
- ``cfg2``: distvideo, 2 ranks, CFG parallel (sp 1);
- ``sp2``: distvideo, 2 ranks, Ulysses sequence parallel (CFG off);
- ``diffusers-ulysses2``: diffusers' WanPipeline with its own context parallelism
  (``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))``) on the same checkpoint, 2 ranks;
- ``ring2``: distvideo, 2 ranks, ring attention (ulysses 1 x ring 2, CFG off), and ``diffusers-ring2``: diffusers'
  ring context parallelism (``ContextParallelConfig(ring_degree=2)``); not in the default modes:
  ``--modes single,ring2,diffusers-ring2``.

Each launch makes one warm-up generation (1 step, same shape), then ``--runs`` timed ones. The modes are launched in
``--rounds`` interleaved rounds (single, cfg2, sp2, diffusers, single, ...), so a burst of load from other processes
on a shared machine spreads over all modes instead of hitting one. The table shows medians over every timed run of
text encoding + denoising, decoding (VAE decode + uint8 frames) and end to end, with min-max and the 1-minute load
average seen at the launches.

    python benchmarks/parallel.py                                  # all modes, 3 rounds of 1 timed run
    python benchmarks/parallel.py --modes single,sp2 --rounds 5 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULT_PREFIX = "PARALLEL_RESULT "
END_TO_END_MODES = ("single", "cfg2", "sp2", "diffusers-ulysses2")
PROMPT = "a red fox running through snow"
NEGATIVE = "blurry, low quality"
MODES: dict[str, dict[str, Any]] = {
    "single": {"world": 1, "sp_size": None, "cfg_parallel": None},
    "cfg2": {"world": 2, "sp_size": 1, "cfg_parallel": True},
    "sp2": {"world": 2, "sp_size": 2, "cfg_parallel": False},
    "diffusers-ulysses2": {"world": 2},
    "ring2": {"world": 2, "sp_size": 2, "cfg_parallel": False, "ring_size": 2},
    "diffusers-ring2": {"world": 2},
    "paired": {"world": 2},
}


# --- inside one launch -----------------------------------------------------------------------------------------------


def request_kwargs(args: argparse.Namespace, steps: int | None = None) -> dict[str, Any]:
    return dict(
        num_frames=args.frames,
        height=args.height,
        width=args.width,
        num_inference_steps=steps or args.steps,
        guidance_scale=args.guidance,
        seed=0,
    )


def run_distvideo(mode: str, args: argparse.Namespace) -> dict[str, Any] | None:
    from distvideo import VideoGenerator

    spec = MODES[mode]
    executor = "inline" if spec["world"] == 1 else "external"
    with VideoGenerator.from_pretrained(
        args.model,
        executor=executor,
        sp_size=spec["sp_size"],
        cfg_parallel=spec["cfg_parallel"],
        ring_size=spec.get("ring_size"),
    ) as gen:
        gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **request_kwargs(args, steps=1))  # warm-up
        runs = []
        for _ in range(args.runs):
            res = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **request_kwargs(args))
            t = res.timings
            runs.append(
                {
                    "text_and_denoise": t["text_encoding"] + t["timesteps"] + t["latents"] + t["denoising"],
                    "text_encoding": t["text_encoding"],
                    "decode": t["decoding"] + t["frames"],
                    "e2e": t["total"],
                }
            )
        if not gen.is_output_rank:
            return None
        return {"mode": mode, "runs": runs, "frames_std": float(res.frames.std())}


def run_diffusers_ulysses(args: argparse.Namespace, mode: str = "diffusers-ulysses2") -> dict[str, Any] | None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig, WanPipeline

    torch.accelerator.device_count = lambda: 1  # type: ignore[method-assign]  # diffusers assumes an accelerator
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    pipe = WanPipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=True)
    degree = "ring_degree" if mode == "diffusers-ring2" else "ulysses_degree"
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(**{degree: dist.get_world_size()}))
    vae = pipe.vae
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)

    def generate(steps: int) -> tuple[dict[str, float], np.ndarray]:
        kwargs = request_kwargs(args, steps)
        generator = torch.Generator("cpu").manual_seed(kwargs.pop("seed"))
        dist.barrier()
        start = time.perf_counter()
        latents = pipe(PROMPT, negative_prompt=NEGATIVE, generator=generator, output_type="latent", **kwargs).frames
        middle = time.perf_counter()
        with torch.no_grad():  # WanPipeline's own decode, as in its __call__
            video = vae.decode(latents.to(vae.dtype) / inv_std + mean, return_dict=False)[0]
            frames = pipe.video_processor.postprocess_video(video, output_type="np")[0]
        frames = np.round(frames * 255).astype(np.uint8)
        end = time.perf_counter()
        return {"text_and_denoise": middle - start, "decode": end - middle, "e2e": end - start}, frames

    generate(1)
    runs = []
    for _ in range(args.runs):
        timing, frames = generate(args.steps)
        runs.append(timing)
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        "mode": mode,
        "runs": runs,
        "frames_std": float(frames.std()),
    }


def run_paired(args: argparse.Namespace) -> dict[str, Any] | None:
    """In ONE 2-rank launch, alternate the same work done each way, so load from other processes hits all alike.

    One denoising step (both CFG branches) at the benchmark shape: one rank (rank 1 waits), cfg=2 (a branch per rank
    + all-gather), distvideo sp=2 (Ulysses plan + text-projection memo, two forwards) and diffusers' Ulysses (two
    forwards); distvideo's transformers carry the text-padding plan, as the engine's do. One decode of the latents:
    diffusers' decode on one rank, distvideo's (CPU kernels: oneDNN 3D convolutions, fast RMS norms) on one rank, and distvideo's banded decode on
    both ranks. Rank 0's CPU time is reported too: it does not count time spent waiting for a core that other
    processes hold.
    """
    import torch
    import torch.distributed as dist
    from diffusers import AutoencoderKLWan, ContextParallelConfig, WanTransformer3DModel

    from distvideo.families.wan.t2v import WanT2VPipeline
    from distvideo.families.wan.text_padding import TextPaddingPlan, TextProjectionMemo
    from distvideo.models.cpu_kernels import use_cpu_kernels
    from distvideo.parallel.ulysses import UlyssesPlan
    from distvideo.parallel.vae import BandedVaeDecoder

    torch.accelerator.device_count = lambda: 1  # type: ignore[method-assign]  # diffusers assumes an accelerator
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(args.model)
    plain, ours, theirs = (WanTransformer3DModel.from_pretrained(folder / "transformer").eval() for _ in range(3))
    TextPaddingPlan().apply(plain)  # distvideo's one-rank transformer (as the worker applies its speed plans)
    TextPaddingPlan().apply(ours)
    declared = WanT2VPipeline.parallel_points  # Wan's hook points and VAE bands, as ParallelContext.plans hands them
    ulysses = UlyssesPlan(dist.group.WORLD, world, rank)
    ulysses.points = declared.sequence
    ulysses.apply(ours)
    TextProjectionMemo().apply(ours)  # as ParallelContext.plans() has it under SP
    theirs.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    stock_vae = AutoencoderKLWan.from_pretrained(folder / "vae").eval()
    vae = AutoencoderKLWan.from_pretrained(folder / "vae").eval()
    use_cpu_kernels(vae)
    banded = BandedVaeDecoder(lambda size: dist.group.WORLD, rank, world)
    banded.bands, banded.banded_vae = declared.vae_bands, declared.banded_vae
    banded.apply(vae)

    gen = torch.Generator("cpu").manual_seed(0)
    z = plain.config.in_channels
    latent_frames = (args.frames - 1) // 4 + 1
    x = torch.randn(1, z, latent_frames, args.height // 8, args.width // 8, generator=gen)
    t = torch.tensor([500.0])
    # one tensor object per text for the whole launch, as a request's embeddings are for all its steps; zero rows
    # after the prompt's tokens, as the pipelines' text encoding leaves them (16 and 9 tokens: the
    # end-to-end prompt and negative prompt under the checkpoint's tokenizer)
    cond, uncond = torch.zeros(2, 1, 512, plain.config.text_dim).unbind(0)
    cond[:, :16], uncond[:, :9] = (
        torch.randn(16, plain.config.text_dim, generator=gen),
        torch.randn(9, plain.config.text_dim, generator=gen),
    )

    def forward(model: Any, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=hidden, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]

    def single_step() -> None:
        if rank == 0:
            forward(plain, x, cond), forward(plain, x, uncond)

    def cfg_step() -> None:
        local = forward(plain, x, (cond, uncond)[rank])
        both = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(both, local)

    def sp_step() -> None:
        forward(ours, x, cond), forward(ours, x, uncond)

    def diffusers_step() -> None:
        forward(theirs, x, cond), forward(theirs, x, uncond)

    def diffusers_decode() -> None:
        if rank == 0:
            stock_vae.decode(x, return_dict=False)

    def single_decode() -> None:
        if rank == 0:
            vae.decode(x, return_dict=False)

    def banded_decode() -> None:
        banded.decode(x)

    steps = {"single": single_step, "cfg2": cfg_step, "sp2": sp_step, "diffusers-ulysses2": diffusers_step}
    decodes = {"single": single_decode, "banded2": banded_decode, "diffusers-single": diffusers_decode}
    times: dict[str, list[float]] = {f"step/{k}": [] for k in steps} | {f"decode/{k}": [] for k in decodes}
    cpu: dict[str, list[float]] = {key: [] for key in times}

    def timed(key: str, fn: Any) -> None:
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.no_grad():
            fn()
        cpu_end = time.process_time()
        dist.barrier()
        times[key].append(time.perf_counter() - start)
        cpu[key].append(cpu_end - cpu_start)

    with torch.no_grad():
        sp_step(), diffusers_step()  # warm-up
    for _ in range(args.paired_steps + 1):
        for name, fn in steps.items():
            timed(f"step/{name}", fn)
    for _ in range(args.paired_decodes):
        for name, fn in decodes.items():
            timed(f"decode/{name}", fn)
    dist.destroy_process_group()
    if rank != 0:
        return None
    for key in list(times):
        if key.startswith("step/"):  # the first alternation warms the caches
            times[key], cpu[key] = times[key][1:], cpu[key][1:]
    return {"mode": "paired", "times": times, "rank0_cpu": cpu}


def child_main(args: argparse.Namespace) -> None:
    if args.child == "paired":
        result = run_paired(args)
    elif args.child in ("diffusers-ulysses2", "diffusers-ring2"):
        result = run_diffusers_ulysses(args, args.child)
    else:
        result = run_distvideo(args.child, args)
    if result is not None:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


# --- the driver ------------------------------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "DISTVIDEO_NUM_THREADS": "1",  # one intra-op thread per rank, as the comparison asks
            "DISTVIDEO_NO_PROGRESS": "1",
            "DISTVIDEO_LOG_LEVEL": "WARNING",
            "HF_HUB_OFFLINE": "1",
        }
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def launch(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    world = MODES[mode]["world"]
    script = [str(Path(__file__).resolve()), f"--child={mode}", f"--model={args.model}", f"--runs={args.runs}"]
    script += [f"--frames={args.frames}", f"--height={args.height}", f"--width={args.width}"]
    script += [f"--steps={args.steps}", f"--guidance={args.guidance}"]
    script += [f"--paired-steps={args.paired_steps}", f"--paired-decodes={args.paired_decodes}"]
    if mode == "single":
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *script]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"{mode} failed (rc={proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def medians(result: dict[str, Any]) -> dict[str, float]:
    keys = ("text_and_denoise", "decode", "e2e")
    return {k: statistics.median(r[k] for r in result["runs"]) for k in keys}


def spread(result: dict[str, Any], key: str) -> str:
    values = [r[key] for r in result["runs"]]
    return f"{min(values):.2f}-{max(values):.2f}"


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    med = {mode: medians(r) for mode, r in results.items()}
    lines = [
        f"Benchmark checkpoint, {args.frames} frames {args.height}x{args.width}, {args.steps} steps, guidance "
        f"{args.guidance}; one thread per rank; {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}); "
        f"{args.rounds} interleaved rounds x {args.runs} timed run(s); median [min-max] in seconds.",
        "",
        "| mode | ranks | text enc. + denoising | decode | end to end | load avg at launches |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        m = med[mode]
        cells = [f"{m[k]:.2f} [{spread(r, k)}]" for k in ("text_and_denoise", "decode", "e2e")]
        loads = ", ".join(f"{x:.1f}" for x in r.get("loads", []))
        lines.append(f"| {mode} | {MODES[mode]['world']} | {' | '.join(cells)} | {loads} |")
    lines.append("")

    def ratio(a: str, b: str, key: str, label: str) -> None:
        if a in med and b in med:
            lines.append(f"- {label}: {med[a][key] / med[b][key]:.2f}x ({a} / {b})")

    ratio("cfg2", "single", "text_and_denoise", "cfg=2 text enc. + denoising vs one rank")
    ratio("sp2", "diffusers-ulysses2", "text_and_denoise", "sp=2 text enc. + denoising vs diffusers' Ulysses")
    ratio("sp2", "single", "text_and_denoise", "sp=2 text enc. + denoising vs one rank")
    ratio("ring2", "diffusers-ring2", "text_and_denoise", "ring=2 text enc. + denoising vs diffusers' ring")
    ratio("ring2", "single", "text_and_denoise", "ring=2 text enc. + denoising vs one rank")
    ratio("cfg2", "single", "decode", "decode on 2 ranks (cfg2 launch) vs one rank")
    ratio("sp2", "single", "decode", "decode on 2 ranks (sp2 launch) vs one rank")
    ratio("diffusers-ulysses2", "single", "decode", "diffusers' decode under its Ulysses (each rank decodes all)")
    ratio("cfg2", "single", "e2e", "cfg=2 end to end vs one rank")
    ratio("sp2", "single", "e2e", "sp=2 end to end vs one rank")
    return "\n".join(lines)


def report_paired(paired: dict[str, Any], args: argparse.Namespace, load: float) -> str:
    med = {k: statistics.median(v) for k, v in paired["times"].items()}
    n_steps, n_decodes = len(paired["times"]["step/single"]), len(paired["times"]["decode/single"])
    lines = [
        f"Paired launch (2 ranks, alternating; load avg {load:.1f} at launch): one denoising step with both CFG branches "
        f"(median of {n_steps}) and one decode of the {args.frames}-frame latents (median of {n_decodes}), seconds.",
        "",
        "| work | way | wall median [min-max] | wall vs one rank | rank-0 CPU median | CPU vs one rank |",
        "|---|---|---|---|---|---|",
    ]
    cpu = {k: statistics.median(v) for k, v in paired["rank0_cpu"].items()}
    for key, values in paired["times"].items():
        kind, way = key.split("/")
        base, cpu_base = med[f"{kind}/single"], cpu[f"{kind}/single"]
        lines.append(
            f"| {kind} | {way} | {med[key]:.2f} [{min(values):.2f}-{max(values):.2f}] | {med[key] / base:.2f}x "
            f"| {cpu[key]:.2f} | {cpu[key] / cpu_base:.2f}x |"
        )
    lines.append("")
    sp, theirs = "step/sp2", "step/diffusers-ulysses2"
    lines.append(
        f"- sp=2 step vs diffusers' Ulysses step: {med[sp] / med[theirs]:.2f}x wall, {cpu[sp] / cpu[theirs]:.2f}x "
        "rank-0 CPU time"
    )
    return "\n".join(lines)


def ensure_checkpoint(path: Path) -> Path:
    if not (path / "model_index.json").is_file():
        from distvideo.testing.checkpoints import build_benchmark_checkpoint

        build_benchmark_checkpoint(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--modes", default=",".join(END_TO_END_MODES), help=f"comma-separated, among {', '.join(END_TO_END_MODES)}"
    )
    parser.add_argument("--model", default=None, help="checkpoint folder (default: build the benchmark checkpoint)")
    parser.add_argument("--runs", type=int, default=1, help="timed runs per launch")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved launches of every mode")
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--height", type=int, default=192)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--paired-steps", type=int, default=20, help="alternations of one step, --paired only")
    parser.add_argument("--paired-decodes", type=int, default=3, help="alternations of one decode, --paired only")
    parser.add_argument("--paired", action="store_true", help="also run the paired (alternating) launch")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    if args.model is None:
        args.model = str(ensure_checkpoint(Path(tempfile.gettempdir()) / "distvideo-benchmark-checkpoint"))
    results: dict[str, dict[str, Any]] = {}
    for round_index in range(args.rounds):
        for mode in [m for m in args.modes.split(",") if m]:
            start, load = time.perf_counter(), os.getloadavg()[0]
            one = launch(mode, args)
            merged = results.setdefault(mode, {"mode": mode, "runs": [], "loads": []})
            merged["runs"] += one["runs"]
            merged["loads"].append(load)
            took = time.perf_counter() - start
            print(
                f"round {round_index} {mode}: {one['runs']} (load {load:.1f}, {took:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    text = report(results, args) if results else ""
    if args.paired:
        start, load = time.perf_counter(), os.getloadavg()[0]
        paired = launch("paired", args)
        took = time.perf_counter() - start
        print(f"paired: (load {load:.1f}, {took:.0f} s)", file=sys.stderr, flush=True)
        results["paired"] = paired
        text += "\n\n" + report_paired(paired, args, load)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "report": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
