"""HunyuanVideo 1.5 with the speed and memory options: `--offload text` and `--offload model` give the bytes of
`--offload none` with both text encoders (Qwen2.5-VL and ByT5) and the VAE in host memory outside their stages, and
`--compile` (regional, its dual-stream blocks) gives frames within 2 of eager. The device is ``cpu:0``, host memory
that a move can still be told apart by (tests/test_offload.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from distvideo import VideoGenerator
from distvideo.config import EngineConfig
from test_hunyuan import NEGATIVE, PROMPT, REQUEST, hunyuan_checkpoint

from background import FolderJob, in_a_process
from conftest import max_abs_diff

pytestmark = pytest.mark.slow


def _generator(model: Path, **options) -> VideoGenerator:
    config = EngineConfig(model=str(model), executor="inline", device="cpu:0", progress=False, **options)
    return VideoGenerator.from_config(config)


def _run(gen: VideoGenerator) -> np.ndarray:
    frames = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **REQUEST).frames
    assert frames is not None
    return frames


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hunyuan_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def plain(model: Path) -> np.ndarray:
    with _generator(model) as gen:
        return _run(gen)


@pytest.mark.parametrize(
    ("mode", "offloaded"),
    [("text", ("text_encoder", "text_encoder_2")), ("model", ("text_encoder", "text_encoder_2", "vae"))],
)
def test_offload_gives_the_same_bytes_with_both_text_encoders_away(
    model: Path, plain: np.ndarray, mode: str, offloaded: tuple[str, ...]
) -> None:
    with _generator(model, offload=mode) as gen:
        frames = _run(gen)
        offload = gen.collective_rpc(lambda worker: worker.pipeline.offload)[0]  # inline: the rank is here
    assert frames.tobytes() == plain.tobytes(), f"offload={mode} changed the frames"
    assert offload.offloaded == offloaded
    assert offload.placement == {name: "host" if name in offloaded else "device" for name in offload.placement}
    # after the placement at load, each offloaded component visits the device once, for its stage
    visits = offload.moves[len(offload.placement) :]
    one_visit = {name: ["device", "host"] for name in offloaded}
    assert {name: [where for n, where in visits if n == name] for name in offloaded} == one_visit
    assert {name for name, _ in visits} == set(offloaded)


def compiled_runs(folder: Path) -> None:
    """On the session's checkpoint, built again here (the same call, so the same bytes): eager and compiled frames
    (FOLDER/frames.npz), the compiled engine's plans and timings (FOLDER/compiled.json)."""
    from distvideo.testing.hunyuan import build_hunyuan_checkpoint

    model = build_hunyuan_checkpoint(folder / "hunyuan15", seed=21)
    with _generator(model) as gen:
        eager = _run(gen)
    with _generator(model, compile=True) as gen:
        result = gen.generate(PROMPT, negative_prompt=NEGATIVE, save_video=False, **REQUEST)
        plans = gen.collective_rpc("applied_plans")[0]
    np.savez(folder / "frames.npz", eager=eager, compiled=result.frames)
    (folder / "compiled.json").write_text(json.dumps({"plans": plans, "timings": result.timings}))


# a cold Inductor compile (28 C++ kernels built by g++, about 40 s here) whose figures are all the test checks: in a
# process of its own, in the background (background.py)
COMPILED = FolderJob("HunyuanVideo 1.5 compiled", "hv15-compile", in_a_process("test_hunyuan_options", "compiled_runs"))
BACKGROUND_JOBS = {"compiled": COMPILED.hooks}


@pytest.fixture
def compiled() -> tuple[dict[str, np.ndarray], dict]:
    folder, proc = COMPILED.result()
    assert proc.returncode == 0, proc.stderr
    frames = np.load(folder / "frames.npz")
    return {name: frames[name] for name in frames.files}, json.loads((folder / "compiled.json").read_text())


def test_compiled_frames_are_within_2_of_eager(compiled, plain: np.ndarray) -> None:
    frames, report = compiled
    assert frames["eager"].tobytes() == plain.tobytes(), "the job's checkpoint is not the session's"
    assert report["plans"]["transformer"][-1] == "compile"
    assert report["timings"]["compile"] > 0
    assert max_abs_diff(frames["compiled"], plain) <= 2
