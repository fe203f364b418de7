"""Image-to-video under a real launcher, from the command line: an image file present on one node and missing on
another exits 2 on every rank, with nothing written (the API's refusal, before any denoising, is checked in the
torchrun launch of tests/test_families_parallel.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from family_checkpoints import BUILD_FAMILY

from background import FolderJob, run_python
from launchers import console_script, format_output, run_launcher

pytestmark = [pytest.mark.launcher, pytest.mark.slow]


def _launch(folder: Path, environ: dict[str, str]) -> subprocess.CompletedProcess:
    """The same command on every rank (`--image $DIR/node-$RANK.png`), the file only on rank 0's "node"; on the
    family's checkpoint, built in a process of its own (the session's bytes)."""
    run_python(BUILD_FAMILY, [str(folder / "model"), "wan22_ti2v_5b"], environ)
    write = "import sys; from distvideo.testing.families import write_test_image as w; w(sys.argv[1], 40, 28, 0)"
    run_python(write, [str(folder / "node-0.png")], environ)
    command = (
        f'"{console_script("distvideo")}" generate --model "{folder}/model" --prompt "a fox"'
        f' --image "{folder}/node-$RANK.png" --num-frames 5 --height 32 --width 64 --steps 2'
        f' --output "{folder}/out/video-$RANK.mp4"; echo "rank $RANK exit $?"'
    )
    return run_launcher("torchrun", ["bash", "-c", command], nproc=2, timeout=300, python=False, base=environ)


# a launch whose outcome is all the test checks: in the background (background.py)
LAUNCH = FolderJob("an image missing on one node, under torchrun", "image-missing", _launch)
BACKGROUND_JOBS = {"launched": LAUNCH.hooks}


launched = LAUNCH.fixture("launched")


def test_cli_image_missing_on_one_node_exits_2_on_every_rank(launched):
    tmp_path, proc = launched
    output = proc.stdout + proc.stderr
    assert "rank 0 exit 2" in output and "rank 1 exit 2" in output, format_output(proc)
    assert output.count("ranks disagree on the arguments of generate") == 2, format_output(proc)
    assert "rank 1: 'not readable on" in output
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
