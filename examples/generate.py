"""One script for every launcher: plain `python`, torchrun, srun or mpirun.

    python examples/generate.py                              # one rank, in process
    python examples/generate.py --num-gpus 2                 # distvideo spawns 2 ranks itself
    torchrun --nproc-per-node 2 examples/generate.py         # each torchrun process is one rank
    srun -n 2 python examples/generate.py                    # each Slurm task is one rank
    mpirun -np 2 python examples/generate.py                 # each MPI process is one rank

Every rank runs the whole script with the same arguments; only rank 0 gets frames and writes the video.
"""

from __future__ import annotations

import argparse

from distvideo import VideoGenerator
from distvideo.models.embedded import DEMO_EXAMPLE_PROMPT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", default=None, help="diffusers-format Wan2.1 folder (default: the embedded demo model)"
    )
    parser.add_argument("--num-gpus", type=int, default=None)
    parser.add_argument(
        "--prompt",
        default=None,
        help="default: a caption of the demo model's grammar without --model, else a scene (a fox in the snow)",
    )
    parser.add_argument("--output", default="outputs/")
    parser.add_argument("--dist-timeout", type=float, default=600.0)
    args = parser.parse_args()

    # the demo model draws only captions of its grammar (docs/demo-model.md); a real checkpoint draws the scene
    prompt = args.prompt or (
        DEMO_EXAMPLE_PROMPT if args.model is None else "a red fox running through fresh snow, golden hour"
    )
    with VideoGenerator.from_pretrained(args.model, num_gpus=args.num_gpus, dist_timeout=args.dist_timeout) as gen:
        result = gen.generate(prompt, seed=42, output_path=args.output)
        if gen.is_output_rank:
            print(f"wrote {result.video_path} ({result.timings['total']:.1f} s)")


if __name__ == "__main__":
    main()
