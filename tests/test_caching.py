"""Step caching (pipelines/caching/): the skip decision is one value per step that every rank agrees on.

Cached inline runs are the reference: the mp executor and torchrun at cfg2, sp2 and cfg2 x sp2 skip the same steps
on every rank and give frames within 2 of them; the cache off leaves frames byte-identical; `distvideo calibrate`
writes the MagCache ratios the loader finds; bad options are refused naming the option. One 4-layer checkpoint, 8
steps at 48 x 48 (27 tokens: sp=2 pads to 28, so the metric's trimming of the padding is exercised).
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from distvideo import VideoGenerator
from distvideo.cli.main import EXIT_BAD_INPUT, main
from distvideo.errors import ConfigError
from distvideo.models.cache_ratios import RATIOS_FILE
from distvideo.models.registry import probe_model
from launch_groups import once, torchrun_case

from background import run_program
from conftest import REPO, max_abs_diff
from launchers import format_output

STEPS = 8
BASE = dict(num_frames=9, height=48, width=48, num_inference_steps=STEPS, guidance_scale=5.0, seed=3)
# thresholds where the test checkpoint skips some steps but not all (checked below, so a cache that never or always
# skips fails)
REQUESTS: dict[str, dict[str, Any]] = {
    "fb": dict(BASE, cache="first-block", cache_threshold=0.6),
    "mag": dict(BASE, cache="mag", cache_threshold=0.1),
    "ts": dict(BASE, cache="taylorseer", cache_max_skip=2),  # computes 0, 3, 6; forecasts the others
}
PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A test checkpoint with its ratios for 8 steps, written by `distvideo calibrate`."""
    from distvideo.testing.checkpoints import build_test_checkpoint

    path = build_test_checkpoint(tmp_path_factory.mktemp("cache") / "tiny-wan-4l")
    assert main(["calibrate", "--model", str(path), "--steps", str(STEPS), "--device", "cpu"]) == 0
    return path


@pytest.fixture(scope="module")
def inline(model: Path) -> dict[str, Any]:
    with VideoGenerator.from_pretrained(str(model), device="cpu", executor="inline") as gen:
        off = gen.generate(PROMPT, save_video=False, **BASE)
        cached = {name: gen.generate(PROMPT, save_video=False, **kw) for name, kw in REQUESTS.items()}
        off_again = gen.generate(PROMPT, save_video=False, **BASE)
    return {"off": off, "off_again": off_again, **cached}


def test_calibrate_writes_ratios_the_loader_finds(model: Path) -> None:
    data = json.loads((model / RATIOS_FILE).read_text())
    ratios = data["ratios"][f"UniPCMultistepScheduler/{STEPS}"]
    assert len(ratios) == STEPS and ratios[0] == 1.0 and all(math.isfinite(r) and r > 0 for r in ratios)
    assert probe_model(str(model)).cache_ratios[f"UniPCMultistepScheduler/{STEPS}"] == ratios


def test_inline_cache_skips_some_steps_and_off_is_unchanged(inline: dict[str, Any]) -> None:
    assert inline["off"].cache is None
    np.testing.assert_array_equal(inline["off_again"].frames, inline["off"].frames)  # the plan passes through
    for name in REQUESTS:
        report = inline[name].cache
        assert report["method"] == REQUESTS[name]["cache"]
        assert 0 < len(report["skipped_steps"]) < STEPS - 1, report
        assert report["computed_steps"] == STEPS - len(report["skipped_steps"])
        assert max_abs_diff(inline[name].frames, inline["off"].frames) > 0  # a skip changes the frames


@pytest.mark.slow
@pytest.mark.parametrize(("num_gpus", "sp_size", "cfg"), [(4, 2, True)])  # cfg2 and sp2 alone: under torchrun below
def test_mp_skips_the_same_steps(model: Path, inline: dict[str, Any], num_gpus: int, sp_size: int, cfg: bool) -> None:
    with VideoGenerator.from_pretrained(
        str(model), executor="mp", device="cpu", num_gpus=num_gpus, sp_size=sp_size, cfg_parallel=cfg
    ) as gen:
        for name, kwargs in REQUESTS.items():
            result = gen.generate(PROMPT, save_video=False, **kwargs)
            assert result.cache == inline[name].cache, (name, result.cache, inline[name].cache)
            assert max_abs_diff(result.frames, inline[name].frames) <= 2


# ring: sp 2 as ring attention, so the first-block metric is reduced over a ring group (issue 33)
TORCHRUN_CASES = {
    "2ranks": (2, [("cfg2", 1, True, None), ("sp2", 2, False, None)]),
    "4ranks": (4, [("sp2cfg2", 2, True, None), ("ring2cfg2", 2, True, 2)]),
}
BUILD_AND_CALIBRATE = (
    "import sys; from distvideo.testing.checkpoints import build_test_checkpoint as b; "
    "from distvideo.cli.main import main; p = b(sys.argv[1]); "
    f"sys.exit(main(['calibrate', '--model', str(p), '--steps', '{STEPS}', '--device', 'cpu']))"
)


@once
def _calibrated(folder: Path, environ: dict[str, str]) -> Path:
    """One calibrated checkpoint for both launches (built in a process of its own: the same bytes and ratios as the
    module's)."""
    model = folder / "tiny-wan-4l"
    build = run_program([sys.executable, "-c", BUILD_AND_CALIBRATE, str(model)], threading.Event(), 300, env=environ)
    assert build.returncode == 0, build.stderr
    return model


def _argv(case: str, folder: Path, environ: dict[str, str]) -> list[str]:
    cases = {
        "model": str(_calibrated(folder, environ)),
        "engines": [
            {"name": n, "sp_size": sp, "cfg_parallel": cfg, "ring_size": ring}
            for n, sp, cfg, ring in TORCHRUN_CASES[case][1]
        ],
        "requests": REQUESTS,
    }
    (folder / "cases.json").write_text(json.dumps(cases))
    return [str(REPO / "tests" / "parallel_scripts" / "cache_cases.py"), str(folder / "cases.json"), str(folder)]


# the launches' scripts, whose outcome is all the test checks: in the background, each in turn with other modules'
# scripts of as many ranks (launch_groups.py)
LAUNCHES = {
    case: torchrun_case(f"step caching, {case}", nproc, functools.partial(_argv, case), timeout=300)
    for case, (nproc, _) in TORCHRUN_CASES.items()
}
BACKGROUND_JOBS = {f"cache_launch[{case}]": launch.hooks for case, launch in LAUNCHES.items()}


@pytest.fixture
def cache_launch(case: str) -> tuple[Path, subprocess.CompletedProcess]:
    return LAUNCHES[case].result()


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.parametrize("case", list(TORCHRUN_CASES))
def test_torchrun_every_rank_skips_the_same_steps(
    case: str, cache_launch: tuple[Path, subprocess.CompletedProcess], model: Path, inline: dict[str, Any]
) -> None:
    folder, proc = cache_launch
    assert proc.returncode == 0, format_output(proc)
    launched_model = Path(json.loads((folder / "cases.json").read_text())["model"])
    ratios = json.loads((launched_model / RATIOS_FILE).read_text())
    assert ratios == json.loads((model / RATIOS_FILE).read_text()), "the launch's checkpoint is not the module's"
    nproc, engines = TORCHRUN_CASES[case]
    for engine, *_ in engines:
        for name in REQUESTS:
            for rank in range(nproc):
                report = json.loads((folder / f"{engine}-{name}-rank{rank}.json").read_text())
                assert report == inline[name].cache, (engine, name, rank, report)
            frames = np.load(folder / f"{engine}-{name}.npy")
            assert max_abs_diff(frames, inline[name].frames) <= 2, (engine, name)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(cache="teacache"), "cache='teacache': unknown method"),
        (dict(cache="first-block", cache_threshold=0.0), "cache_threshold=0.0"),
        (dict(cache="first-block", cache_threshold=float("nan")), "cache_threshold=nan"),
        (dict(cache="mag", cache_max_skip=0), "cache_max_skip=0"),
        (dict(cache="mag", num_inference_steps=5), "no MagCache ratios for 5 steps"),
        (dict(cache="first-block", num_inference_steps=4), "num_inference_steps=4 is a few-step schedule"),
        (dict(cache="taylorseer", cache_threshold=0.1, num_inference_steps=8), "takes no threshold"),
    ],
)
def test_bad_options_are_refused_before_loading(model: Path, kwargs: dict[str, Any], needle: str) -> None:
    from distvideo.request import GenerationRequest

    info = probe_model(str(model))
    with pytest.raises(ConfigError) as exc:
        info.resolve_request(GenerationRequest(prompt=PROMPT, **kwargs))
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--cache", "teacache"], "invalid choice: 'teacache'"),
        (["--cache", "first-block", "--cache-threshold", "-1"], "--cache-threshold -1.0 must be"),
        (["--cache", "mag", "--steps", "5"], "no MagCache ratios for 5 steps"),
    ],
)
def test_cli_exits_2_naming_the_option(
    model: Path, no_weights_loaded: None, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code = main(["generate", "--model", str(model), "--device", "cpu", "--prompt", PROMPT, *argv])
    assert code == EXIT_BAD_INPUT
    assert needle in capsys.readouterr().err


def test_two_experts_reset_at_the_boundary_and_image_to_video_caches(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Wan2.2 A14B: the first low-noise step is computed however high the threshold (the cache is forgotten at the
    switch); Wan2.1 I2V caches like text-to-video."""
    from family_checkpoints import family_checkpoint, test_image

    # UniPC with shift 12 at 6 steps: 4 high-noise steps (t >= 875), then the low-noise expert from step 4
    moe = family_checkpoint(tmp_path_factory, "wan22_t2v_a14b")
    kwargs = dict(num_frames=5, height=32, width=48, num_inference_steps=6, guidance_scale=4.0, seed=2)
    with VideoGenerator.from_pretrained(str(moe), device="cpu", executor="inline") as gen:
        result = gen.generate(PROMPT, save_video=False, cache="first-block", cache_threshold=1e6, **kwargs)
    boundary = 4  # with a threshold no change reaches, only the switch makes a step computed
    assert result.cache["skipped_steps"] == [s for s in range(1, 6) if s != boundary], result.cache
    i2v = family_checkpoint(tmp_path_factory, "wan21_i2v")
    image = test_image(tmp_path_factory)
    kwargs = dict(image=str(image), num_frames=5, height=48, width=80, num_inference_steps=5, seed=1)
    with VideoGenerator.from_pretrained(str(i2v), device="cpu", executor="inline") as gen:
        off = gen.generate(PROMPT, save_video=False, **kwargs)
        cached = gen.generate(PROMPT, save_video=False, cache="first-block", cache_threshold=1e6, **kwargs)
    assert cached.cache["skipped_steps"] == [1, 2, 3, 4], cached.cache
    assert max_abs_diff(cached.frames, off.frames) > 0


def test_mag_threshold_follows_the_step_count(model: Path) -> None:
    """The documented rule (0.006 per step between 0.06 and 0.24): diffusers' 0.06 at the 8 calibrated steps, and
    the thresholds docs/caching.md measured at 20 and 50 steps."""
    from distvideo.models.cache_ratios import mag_threshold
    from distvideo.request import GenerationRequest

    resolved = probe_model(str(model)).resolve_request(GenerationRequest(prompt=PROMPT, cache="mag", **BASE))
    assert resolved.cache_threshold == 0.06 and resolved.cache_max_skip == 3
    assert [mag_threshold(steps) for steps in (5, 20, 30, 50, 100)] == pytest.approx([0.06, 0.12, 0.18, 0.24, 0.24])


def test_taylorseer_forecasts_one_step_ahead_from_the_last_two_computed_steps() -> None:
    from distvideo.pipelines.caching import CacheSession
    from distvideo.pipelines.caching.session import CacheSettings
    from distvideo.pipelines.caching.taylorseer import TaylorSeerCache

    session = CacheSession(TaylorSeerCache(CacheSettings(threshold=0.0, warmup_steps=1, max_skip=2), []))
    r0, r3 = torch.tensor([1.0, 2.0]), torch.tensor([4.0, -1.0])
    for step, residual in ((0, r0), (3, r3)):
        session.begin_step(step)
        session.method.computed(session, 0, residual)
    session.begin_step(4)  # one step ahead: the slope over the last gap
    torch.testing.assert_close(session.method.replay(session, 0, r0), r3 + (r3 - r0) / 3, rtol=0, atol=0)
    session.begin_step(5)  # two steps ahead: held at the one-step value
    torch.testing.assert_close(session.method.replay(session, 0, r0), r3 + (r3 - r0) * (1 / 3), rtol=0, atol=0)
    session.switch(1)
    session.switch(2)  # an expert boundary: only the new transformer's steps count
    session.begin_step(6)
    session.method.computed(session, 0, r0)
    session.begin_step(7)
    assert torch.equal(session.method.replay(session, 0, r0), r0)  # one computed step: reused as it is


def test_a_family_without_cache_points_is_refused_before_loading(model: Path) -> None:
    import dataclasses

    from distvideo.request import GenerationRequest

    info = probe_model(str(model))
    undeclared = dataclasses.replace(info, family=dataclasses.replace(info.family, cache_points=None))
    with pytest.raises(ConfigError, match="declares no cache points") as exc:
        undeclared.resolve_request(GenerationRequest(prompt=PROMPT, cache="first-block", **BASE))
    assert exc.value.param == "cache"
    undeclared.resolve_request(GenerationRequest(prompt=PROMPT, **BASE))  # uncached: served


def test_cache_with_compile_is_refused_naming_the_option(model: Path) -> None:
    """--compile leaves the step-cache hooks off (compiled blocks would trace the decisions): a cached request is
    refused with a ConfigError (exit 2 at the CLI), and the engine serves the next request."""
    with VideoGenerator.from_pretrained(str(model), device="cpu", executor="inline", compile=True) as gen:
        assert "step-cache" not in gen.collective_rpc("applied_plans")[0]["transformer"]
        with pytest.raises(ConfigError, match="not served with --compile") as exc:
            gen.generate(PROMPT, save_video=False, **REQUESTS["fb"])
    assert exc.value.param == "cache"
