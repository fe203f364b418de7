"""Image-to-video under a real launcher, from the command line: an image file present on one node and missing on
another exits 2 on every rank, with nothing written (the API's refusal, before any denoising, is checked in the
torchrun launch of tests/test_families_parallel.py)."""

from __future__ import annotations

import pytest

from family_checkpoints import family_checkpoint, test_image

from launchers import console_script, format_output, run_launcher

pytestmark = [pytest.mark.launcher, pytest.mark.slow]


def test_cli_image_missing_on_one_node_exits_2_on_every_rank(tmp_path_factory, tmp_path):
    """The same command on every rank (`--image $DIR/node-$RANK.png`), the file only on rank 0's "node"."""
    model = family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")
    (tmp_path / "node-0.png").write_bytes(test_image(tmp_path_factory).read_bytes())
    command = (
        f'"{console_script("distvideo")}" generate --model "{model}" --prompt "a fox" --image "{tmp_path}/node-$RANK.png"'
        f' --num-frames 5 --height 32 --width 64 --steps 2 --output "{tmp_path}/out/video-$RANK.mp4"; echo "rank $RANK exit $?"'
    )
    proc = run_launcher("torchrun", ["bash", "-c", command], nproc=2, timeout=300, python=False)
    output = proc.stdout + proc.stderr
    assert "rank 0 exit 2" in output and "rank 1 exit 2" in output, format_output(proc)
    assert output.count("ranks disagree on the arguments of generate") == 2, format_output(proc)
    assert "rank 1: 'not readable on" in output
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
