"""Shared fixtures: small random-weight checkpoints built by the repo's own builder (nothing is downloaded)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DISTVIDEO_NO_PROGRESS", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    from distvideo.models.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def test_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 transformer layers, UniPC scheduler (the real Wan2.1 scheduler config)."""
    from distvideo.testing.checkpoints import build_test_checkpoint

    return build_test_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-wan-4l")


def diffusers_frames(model: Path, prompt: str, **kwargs) -> np.ndarray:  # noqa: F821
    """diffusers' WanPipeline frames as uint8 (output_type='np', times 255, rounded)."""
    import numpy as np
    import torch
    from diffusers import WanPipeline

    seed = kwargs.pop("seed", 0)
    pipe = WanPipeline.from_pretrained(str(model))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs).frames[0]
    return np.round(out * 255).astype(np.uint8)


def max_abs_diff(a, b) -> int:
    import numpy as np

    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def read_video(path: str | Path):
    """Decoded frames (T, H, W, 3) uint8 of an mp4, and its codec and pixel format."""
    import av
    import numpy as np

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        codec, pix_fmt = stream.codec_context.name, stream.codec_context.pix_fmt
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    return np.stack(frames), codec, pix_fmt


def _signal_state() -> tuple[object, object, frozenset[int]]:
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else set()
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), frozenset(mask)


@pytest.fixture(autouse=True)
def _signals_left_as_found():
    """Every test leaves the stop signals' handlers and the main thread's signal mask as it found them: a blocked or
    ignored SIGINT leaks into every process the test run starts afterwards (both survive exec)."""
    before = _signal_state()
    yield
    after = _signal_state()
    assert after == before, f"the test changed the signal state (SIGINT, SIGTERM handlers, mask): {before} -> {after}"
