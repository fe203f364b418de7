"""Record, from the code of an old commit, the frames `tests/test_frames_recorded.py` holds the code to.

What the recordings guard: the restructurings that promise "every frame kept" must not change a single value of the
API's frames. The parity tests bound the code against diffusers within 2 levels; a recording is stricter (bit for bit
on a machine of a recorded kind) and independent of today's code, because it is made by an old commit's code in a
git worktree, not by the code under test. Two sets:

- `restructure` (tests/data/frames_before_restructure.npz, commit 1d359f3, the last before issue 13's restructuring):
  the test's request inline and under the mp executor with sp=2.
- `reshaping` (tests/data/frames_before_reshaping.npz, commit 0de9300, the last before issue 27's reshaping of the
  executors, process groups and plans): the same request under a 2-rank torchrun launch (the external executor) with
  sp=2, with cfg=2, and a batch of two items over 2 replicas (tests/rank_scripts/recorded_layouts.py), frames and the
  sha256 of every video written.

Float rounding depends on the CPU's kernels, so a recording is keyed by the machine's numerics fingerprint
(`test_frames_recorded.numerics_fingerprint()`); on a machine of a kind not recorded yet the test compares frames
within the parity tolerance (and not the video bytes), and this script adds that kind:

    .venv/bin/python scripts/record_frames.py [--set reshaping]            # add this machine's kind
    .venv/bin/python scripts/record_frames.py [--set reshaping] --check    # record again and compare

It runs the old commit's code with the venv's packages (torch 2.13.0 CPU) and MKL_CBWR=AUTO,STRICT (what distvideo
sets today; 1d359f3 did not set it), and today's request and rank script. About a minute per set on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

#: runs in the old commit's worktree (PYTHONPATH=<worktree>/src): the test's request, inline and mp sp=2
API_CHILD = """
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

#: builds the test checkpoint with the old commit's code
CHECKPOINT_CHILD = """
import sys
from distvideo.testing.checkpoints import build_test_checkpoint
build_test_checkpoint(sys.argv[1])
"""


def run_api(tmp: Path, env: dict[str, str]) -> dict[str, np.ndarray]:
    out = tmp / "frames.npz"
    subprocess.run([sys.executable, "-c", API_CHILD, str(tmp), str(out), str(TESTS)], check=True, env=env, cwd=tmp)
    with np.load(out) as data:
        return {name: data[name] for name in data.files}


def run_launched(tmp: Path, env: dict[str, str]) -> dict[str, np.ndarray]:
    """tests/rank_scripts/recorded_layouts.py under a 2-rank torchrun launch; each rank's frames and video hashes."""
    ckpt = tmp / "tiny-wan-4l"
    subprocess.run([sys.executable, "-c", CHECKPOINT_CHILD, str(ckpt)], check=True, env=env, cwd=tmp)
    out = tmp / "launched"
    script = TESTS / "rank_scripts" / "recorded_layouts.py"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    launch += ["--local-addr", "127.0.0.1", "--max-restarts", "0"]
    subprocess.run([*launch, str(script), str(ckpt), str(out)], check=True, env=env, cwd=tmp)
    sys.path.insert(0, str(TESTS / "rank_scripts"))
    from recorded_layouts import read_outputs

    return read_outputs(out)


@dataclasses.dataclass(frozen=True)
class RecordingSet:
    commit: str
    data: Path
    run: Callable[[Path, dict[str, str]], dict[str, np.ndarray]]


SETS = {
    "restructure": RecordingSet("1d359f3", TESTS / "data" / "frames_before_restructure.npz", run_api),
    "reshaping": RecordingSet("0de9300", TESTS / "data" / "frames_before_reshaping.npz", run_launched),
}


def record(recording: RecordingSet) -> dict[str, np.ndarray]:
    """The frames of the set's commit's code on this machine, from a throwaway git worktree."""
    with tempfile.TemporaryDirectory(prefix="distvideo-record-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), recording.commit], check=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree / "src"), "MKL_CBWR": "AUTO,STRICT", "HF_HUB_OFFLINE": "1"}
            env.pop("DISTVIDEO_MODEL", None)
            return recording.run(Path(tmp), env)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def fingerprint() -> str:
    os.environ["MKL_CBWR"] = "AUTO,STRICT"
    sys.path.insert(0, str(TESTS))
    from test_frames_recorded import numerics_fingerprint

    return numerics_fingerprint()


def compare(kind: str, frames: dict[str, np.ndarray], stored: dict[str, np.ndarray], commit: str) -> int:
    keys = {name: f"{kind}_{name}" for name in frames}
    missing = [key for key in keys.values() if key not in stored]
    if missing:
        print(f"record_frames: machine kind {kind} is not recorded ({missing})", file=sys.stderr)
        return 1
    same = {name: np.array_equal(frames[name], stored[key]) for name, key in keys.items()}
    shown = ", ".join(f"{name} {'identical' if ok else 'DIFFERENT'}" for name, ok in same.items())
    print(f"record_frames: machine kind {kind}, commit {commit}: {shown}")
    return 0 if all(same.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=sorted(SETS), default="restructure", help="which recordings")
    parser.add_argument("--commit", help="the commit whose code records the frames (default: the set's)")
    parser.add_argument("--data", type=Path, help="the recordings file (default: the set's, which the test reads)")
    parser.add_argument("--check", action="store_true", help="compare with the stored recording; write nothing")
    args = parser.parse_args(argv)
    chosen = SETS[args.set]
    recording = dataclasses.replace(chosen, commit=args.commit or chosen.commit, data=args.data or chosen.data)
    kind = fingerprint()
    stored: dict[str, np.ndarray] = {}
    if recording.data.is_file():
        with np.load(recording.data) as data:
            stored = {name: data[name] for name in data.files}
    frames = record(recording)
    keys = {name: f"{kind}_{name}" for name in frames}
    if args.check or all(key in stored for key in keys.values()):
        return compare(kind, frames, stored, recording.commit)
    stored.update({key: frames[name] for name, key in keys.items()})
    recording.data.parent.mkdir(parents=True, exist_ok=True)
    tmp = recording.data.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **stored)
    tmp.replace(recording.data)
    print(f"record_frames: added machine kind {kind} ({', '.join(keys.values())}) to {recording.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
