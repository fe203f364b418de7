"""The single-rank speed plans (docs/performance.md) against diffusers' own modules, one thread, alternating.

- transformer: one forward of the benchmark checkpoint's transformer at 33 x 192 x 192 with a text of `--text-rows`
  real rows (the rest zero padding, as the pipelines leave it), diffusers' module against the same module with
  distvideo's text-padding plan.
- decode: one VAE decode of the 9 latent frames, diffusers' module against the same module with the CPU kernels.

The two ways alternate `--runs` times, so drifting machine speed hits both alike; medians, and the max abs
difference of the outputs.

    python benchmarks/speed_plans.py --runs 15 --decodes 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def alternate(ways: dict[str, Any], runs: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.no_grad():
        for fn in ways.values():
            fn()  # warm-up
        for _ in range(runs):
            for name, fn in ways.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="alternations of one transformer forward")
    parser.add_argument("--decodes", type=int, default=3, help="alternations of one VAE decode")
    parser.add_argument("--text-rows", type=int, default=16, help="real text rows of 512")
    args = parser.parse_args()

    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from distvideo.families.wan.text_padding import TextPaddingPlan
    from distvideo.models.cpu_kernels import use_cpu_kernels
    from distvideo.testing.checkpoints import build_benchmark_checkpoint

    torch.set_num_threads(1)
    folder = Path(tempfile.gettempdir()) / "distvideo-benchmark-checkpoint"
    if not (folder / "model_index.json").is_file():
        build_benchmark_checkpoint(folder)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 9, 24, 24, generator=gen)
    t = torch.tensor([500.0])

    theirs, ours = (WanTransformer3DModel.from_pretrained(folder / "transformer").eval() for _ in range(2))
    TextPaddingPlan().apply(ours)
    text = torch.zeros(1, 512, theirs.config.text_dim)
    text[:, : args.text_rows] = torch.randn(args.text_rows, theirs.config.text_dim, generator=gen)

    def forward(model: Any) -> torch.Tensor:
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    med = alternate({"diffusers": lambda: forward(theirs), "text padding": lambda: forward(ours)}, args.runs)
    with torch.no_grad():
        diff = (forward(ours) - forward(theirs)).abs().max().item()
    print(f"transformer forward, {args.text_rows} real text rows of 512, medians of {args.runs}:")
    print(f"  diffusers {med['diffusers']:.3f} s, text-padding plan {med['text padding']:.3f} s: "
          f"{med['text padding'] / med['diffusers']:.2f}x; max abs difference {diff:.1e}")  # fmt: skip

    stock, fast = (AutoencoderKLWan.from_pretrained(folder / "vae").eval() for _ in range(2))
    use_cpu_kernels(fast)
    med = alternate({"diffusers": lambda: stock.decode(x), "cpu kernels": lambda: fast.decode(x)}, args.decodes)
    with torch.no_grad():
        a, b = stock.decode(x, return_dict=False)[0], fast.decode(x, return_dict=False)[0]
    to_uint8 = lambda v: (v / 2 + 0.5).clamp(0, 1).mul(255).round()  # noqa: E731
    print(f"VAE decode of 33 frames of 192 x 192, medians of {args.decodes}:")
    print(f"  diffusers {med['diffusers']:.2f} s, CPU kernels {med['cpu kernels']:.2f} s: "
          f"{med['cpu kernels'] / med['diffusers']:.2f}x; max abs difference {(a - b).abs().max().item():.1e} "
          f"(uint8: {(to_uint8(a) - to_uint8(b)).abs().max().item():.0f})")  # fmt: skip


if __name__ == "__main__":
    main()
