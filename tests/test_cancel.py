"""Stopping a request between denoising steps (issue 14: timeouts that cancel): request_timeout, cancel() from
another thread, progress after every step; on every executor the ranks stop at the same step and the generator
stays usable; a collective_rpc past its timeout tears the mp workers down instead of queueing the next call."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from distvideo import GenerationCancelled, GenerationTimeout, VideoGenerator
from distvideo.cli.main import main
from distvideo.pipelines.control import StepControl
from launch_groups import torchrun_case

from conftest import REPO
from launchers import format_output
from ray_cluster import session_cluster  # noqa: F401 (the fixture ray_cluster)

REQUEST = dict(num_frames=9, height=32, width=48, seed=1, save_video=False)
LONG = 400  # steps: far more than a test ever waits for


# --- the decision between two steps ------------------------------------------------------------------------------------
def test_step_control_reports_then_stops_for_the_reason_given():
    seen: list[tuple[int, int]] = []
    StepControl(on_progress=lambda d, t: seen.append((d, t))).after_step(1, 4)
    assert seen == [(1, 4)]
    with pytest.raises(GenerationCancelled, match="after step 2 of 4") as cancelled:
        StepControl(cancelled=lambda: True).after_step(2, 4)
    assert not isinstance(cancelled.value, GenerationTimeout)
    with pytest.raises(GenerationTimeout, match="request_timeout=1e-09"):
        StepControl(timeout=1e-9).after_step(1, 4)
    StepControl(timeout=3600, cancelled=lambda: False).after_step(4, 4)  # neither: goes on


# --- inline, mp and ray (the session's local cluster, tests/ray_cluster.py) -------------------------------------------
@pytest.fixture(scope="module", params=["inline", "mp", pytest.param("ray", marks=pytest.mark.slow)])
def gen(request):
    kwargs = {"executor": request.param}
    if request.param in ("mp", "ray"):
        kwargs["num_gpus"] = 2
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    with VideoGenerator.from_pretrained(**kwargs) as generator:
        yield generator


def test_progress_after_every_step(gen):
    seen: list[tuple[int, int]] = []
    gen.generate("a tiny boat", num_inference_steps=3, on_progress=lambda d, t: seen.append((d, t)), **REQUEST)
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_cancel_from_another_thread_stops_the_request_and_the_next_one_runs(gen):
    reference = gen.generate("a tiny boat", num_inference_steps=2, **REQUEST).frames
    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        if done == 2:  # as a server's handler would: another thread calls cancel()
            canceller = threading.Thread(target=gen.cancel)
            canceller.start()
            canceller.join()

    with pytest.raises(GenerationCancelled, match="every rank stopped after step") as info:
        gen.generate("a tiny boat", num_inference_steps=LONG, on_progress=progress, **REQUEST)
    assert not isinstance(info.value, GenerationTimeout)
    assert 2 <= seen[-1] < LONG
    # nothing stale: the next request gives the same frames as before the cancelled one
    assert np.array_equal(gen.generate("a tiny boat", num_inference_steps=2, **REQUEST).frames, reference)


def test_cancel_between_requests_does_not_stop_the_next_one(gen):
    gen.cancel()
    assert gen.generate("a tiny boat", num_inference_steps=2, **REQUEST).frames is not None


def test_request_timeout_stops_at_the_next_step(gen, tmp_path):
    target = tmp_path / "never.mp4"
    with pytest.raises(GenerationTimeout, match=r"request_timeout=0.001 s and was stopped after step \d+ of 400"):
        gen.generate(
            "a tiny boat",
            num_inference_steps=LONG,
            request_timeout=0.001,
            **{**REQUEST, "save_video": True, "output_path": str(target)},
        )
    assert list(tmp_path.iterdir()) == []
    assert gen.generate("a tiny boat", num_inference_steps=2, **REQUEST).frames is not None


def test_request_timeout_on_the_command_line_exits_1_and_writes_nothing(tmp_path, capsys):
    argv = ["generate", "--prompt", "x", "--num-frames", "9", "--height", "32", "--width", "48", "--steps", "400"]
    assert main([*argv, "--request-timeout", "0.001", "--executor", "inline", "--output", str(tmp_path)]) == 1
    assert "request_timeout=0.001" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_a_bad_request_timeout_exits_2(value, capsys):
    assert main(["generate", "--prompt", "x", "--request-timeout", value]) == 2
    err = capsys.readouterr().err  # read once: a second read returns only what was written since
    assert "argument --request-timeout: expected a" in err and f"got '{value}'" in err, err


# --- under a launcher --------------------------------------------------------------------------------------------------
def _argv(folder: Path, environ: dict[str, str]) -> list[str]:
    return [str(REPO / "tests" / "rank_scripts" / "stop_ranks.py"), str(folder)]


# a launch whose outcome is all the test checks: in the background (background.py)
LAUNCH = torchrun_case("stopping under torchrun", 2, _argv, timeout=300)
BACKGROUND_JOBS = {"launched": LAUNCH.hooks}


launched = LAUNCH.fixture("launched")


@pytest.mark.launcher
def test_every_launched_rank_stops_at_the_same_step(launched):
    """request_timeout, and cancel() on rank 1 only: both ranks raise the same error after the same step, and the
    process group stays usable for the next request."""
    tmp_path, proc = launched
    assert proc.returncode == 0, format_output(proc)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["timeout"] == r1["timeout"] and "was stopped after step" in r0["timeout"]
    assert r0["cancel"] == r1["cancel"] and r0["cancel"].startswith("GenerationCancelled:")
    assert r0["steps_seen"] == r1["steps_seen"] and r0["steps_seen"][-1] == 3  # rank 1 cancelled after step 3
    assert r0["after"] == [9, 32, 48, 3] and r1["after"] is None
