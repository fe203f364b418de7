"""Record, from the code of an old commit, the frames `tests/test_frames_recorded.py` holds the code to.

What the recording guards: the restructurings (issue 13's, and every later one that promises "every frame kept")
must not change a single value of the API's frames, inline and under the mp executor with sp=2. The parity tests
bound the code against diffusers within 2 levels; this recording is stricter (bit for bit on a machine of a recorded
kind) and independent of today's code, because it is made by the code of `--commit` (1d359f3, the last commit before
issue 13's restructuring) in a git worktree, not by the code under test.

Float rounding depends on the CPU's kernels, so a recording is keyed by the machine's numerics fingerprint
(`test_frames_recorded.numerics_fingerprint()`); on a machine of a kind not recorded yet the test compares within
the parity tolerance, and this script adds that kind:

    .venv/bin/python scripts/record_frames.py            # add this machine's kind (refuses to overwrite)
    .venv/bin/python scripts/record_frames.py --check    # record again and compare with what is stored

It runs the old commit's `build_test_checkpoint` and `VideoGenerator` with the venv's packages (torch 2.13.0 CPU)
and MKL_CBWR=AUTO,STRICT (what distvideo sets today; the old commit did not set it). About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data" / "frames_before_restructure.npz"
NAMES = ("inline", "mp_sp2")

#: runs in the old commit's worktree (PYTHONPATH=<worktree>/src): the test's request, inline and mp sp=2
CHILD = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[3])
import distvideo
assert distvideo.__file__.startswith(sys.argv[1]), f"not the old commit's code: {distvideo.__file__}"
from distvideo import VideoGenerator
from distvideo.testing.checkpoints import build_test_checkpoint
from test_frames_recorded import PROMPT, REQUEST

ckpt = build_test_checkpoint(sys.argv[1] + "/tiny-wan-4l")
frames = {}
with VideoGenerator.from_pretrained(ckpt, executor="inline") as gen:
    frames["inline"] = gen.generate(PROMPT, **REQUEST).frames
with VideoGenerator.from_pretrained(ckpt, executor="mp", num_gpus=2, cfg_parallel=False, sp_size=2) as gen:
    frames["mp_sp2"] = gen.generate(PROMPT, **REQUEST).frames
np.savez(sys.argv[2], **frames)
"""


def record(commit: str, tests: Path) -> dict[str, np.ndarray]:
    """The frames of `commit`'s code on this machine, from a throwaway git worktree."""
    with tempfile.TemporaryDirectory(prefix="distvideo-record-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree / "src"), "MKL_CBWR": "AUTO,STRICT", "HF_HUB_OFFLINE": "1"}
            env.pop("DISTVIDEO_MODEL", None)
            out = Path(tmp) / "frames.npz"
            # the tests' request and fingerprint come from today's test module (the request is the test's)
            cmd = [sys.executable, "-c", CHILD, tmp, str(out), str(tests)]
            subprocess.run(cmd, check=True, env=env, cwd=tmp)
            with np.load(out) as data:
                return {name: data[name] for name in NAMES}
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def fingerprint(tests: Path) -> str:
    os.environ["MKL_CBWR"] = "AUTO,STRICT"
    sys.path.insert(0, str(tests))
    from test_frames_recorded import numerics_fingerprint

    return numerics_fingerprint()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="1d359f3", help="the commit whose code records the frames")
    parser.add_argument("--data", type=Path, default=DATA, help="the recordings file (default: the test's)")
    parser.add_argument("--check", action="store_true", help="compare with the stored recording; write nothing")
    args = parser.parse_args(argv)
    tests = REPO / "tests"
    kind = fingerprint(tests)
    stored: dict[str, np.ndarray] = {}
    if args.data.is_file():
        with np.load(args.data) as data:
            stored = {name: data[name] for name in data.files}
    frames = record(args.commit, tests)
    keys = {name: f"{kind}_{name}" for name in NAMES}
    if args.check or all(key in stored for key in keys.values()):
        missing = [key for key in keys.values() if key not in stored]
        if missing:
            print(f"record_frames: machine kind {kind} is not recorded in {args.data} ({missing})", file=sys.stderr)
            return 1
        same = {name: np.array_equal(frames[name], stored[key]) for name, key in keys.items()}
        print(f"record_frames: machine kind {kind}, commit {args.commit}: " + ", ".join(
            f"{name} {'identical' if ok else 'DIFFERENT'}" for name, ok in same.items()
        ))  # fmt: skip
        return 0 if all(same.values()) else 1
    stored.update({key: frames[name] for name, key in keys.items()})
    args.data.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.data.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **stored)
    tmp.replace(args.data)
    print(f"record_frames: added machine kind {kind} ({', '.join(keys.values())}) to {args.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
