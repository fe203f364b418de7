"""Image-to-video under a real launcher: an image file present on one node and missing on another is refused on
every rank before any denoising (API and CLI), and the same file at each node's own path is accepted."""

from __future__ import annotations

import json

import pytest

from family_checkpoints import family_checkpoint, test_image

from conftest import REPO
from launchers import console_script, format_output, run_launcher

pytestmark = [pytest.mark.launcher, pytest.mark.slow]


def test_image_missing_on_one_node_is_refused_on_every_rank(tmp_path_factory, tmp_path):
    model = family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")
    image = test_image(tmp_path_factory)
    script = REPO / "tests" / "rank_scripts" / "family_image_ranks.py"
    proc = run_launcher("torchrun", [str(script), str(model), str(image), str(tmp_path)], nproc=2, timeout=300)
    assert proc.returncode == 0, format_output(proc)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        error = report["error"]
        assert error is not None and error["type"] == "DivergentCallError", report
        assert "rank 1: 'not readable on" in error["message"], error["message"]  # whose file, and where
        assert "FileNotFoundError" in error["message"], error["message"]
        assert report["forwards_after_refusal"] == [0, 0], "no rank may denoise a refused request"
        assert report["forwards_after_success"] == [2, 2]  # the same bytes at another path: accepted (2 steps)
    assert reports[0]["error"]["message"] == reports[1]["error"]["message"], "the same words on every rank"
    assert reports[0]["then_generated"]


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


@pytest.mark.slow
def test_mp_executor_takes_an_image_array(tmp_path_factory):
    """Ranks distvideo spawns itself get the image (here a uint8 array) through the mp executor's pipes."""
    import numpy as np
    from PIL import Image

    from distvideo import VideoGenerator
    from family_checkpoints import max_abs_diff

    model = family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")
    pixels = np.asarray(Image.open(test_image(tmp_path_factory)).convert("RGB"))
    kwargs = dict(image=pixels, num_frames=5, height=64, width=64, num_inference_steps=2, seed=9, save_video=False)
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        single = gen.generate("a fox", **kwargs).frames
    with VideoGenerator.from_pretrained(model, num_gpus=2, executor="mp", sp_size=2) as gen:
        spawned = gen.generate("a fox", **kwargs).frames
    assert single.std() > 1.0 and max_abs_diff(spawned, single) <= 2
