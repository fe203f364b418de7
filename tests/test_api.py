"""The public API on the inline executor: results, collective_rpc, life cycle."""

from __future__ import annotations

import pytest

from distvideo import ConfigError, VideoGenerator
from distvideo.config import EngineConfig
from distvideo.executors.base import RankFailure


@pytest.fixture(scope="module")
def gen(tiny_model):
    with VideoGenerator.from_pretrained(executor="inline") as g:
        yield g


def test_default_model_is_embedded(gen, tiny_model):
    assert gen.model_info.path == tiny_model.resolve()


def test_result_fields(gen, tmp_path):
    res = gen.generate("a boat", num_frames=5, height=32, width=32, num_inference_steps=2, output_path=str(tmp_path))
    assert res.frames.shape == (5, 32, 32, 3) and res.frames.dtype.name == "uint8"
    assert res.video_path is not None and res.video_path.endswith("a_boat_seed0.mp4")
    assert {"text_encoding", "denoising", "decoding", "total"} <= set(res.timings)
    assert res.timings["total"] >= res.timings["denoising"] > 0
    assert res.peak_memory_mb > 0 and res.seed == 0
    assert gen.is_output_rank


def test_no_save_no_frames(gen, tmp_path):
    res = gen.generate(
        "a boat", num_frames=5, height=32, width=32, num_inference_steps=1, save_video=False, return_frames=False
    )
    assert res.frames is None and res.video_path is None


def test_collective_rpc_method_and_callable(gen):
    assert gen.collective_rpc("ping") == [0]
    assert gen.collective_rpc(lambda w, x: (w.rank, w.world_size, str(w.device), x), args=(5,)) == [(0, 1, "cpu", 5)]


def test_collective_rpc_failure_names_rank_and_stays_usable(gen):
    def boom(worker):
        raise ValueError("planted failure")

    with pytest.raises(RankFailure, match=r"rank 0: ValueError: planted failure"):
        gen.collective_rpc(boom)
    assert gen.collective_rpc("ping") == [0]


def test_bad_request_fails_before_work(gen, monkeypatch):
    pipeline = gen.executor.worker.pipeline
    monkeypatch.setattr(
        type(pipeline), "__call__", lambda *a, **k: pytest.fail("a refused request reached the pipeline")
    )
    with pytest.raises(ConfigError, match="height=40"):
        gen.generate("x", height=40)


def test_the_load_tripwire_catches_a_load(no_weights_loaded, tiny_model):
    """The `no_weights_loaded` fixture the "refused before loading" tests rely on does fire when weights load."""
    with pytest.raises(AssertionError, match="model weights were loaded"):
        VideoGenerator.from_pretrained(tiny_model, executor="inline")


def test_shutdown_is_idempotent(tiny_model):
    g = VideoGenerator.from_pretrained(tiny_model, executor="inline")
    g.shutdown()
    g.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        g.generate("x")


def test_from_pretrained_takes_any_engine_option_by_name(tiny_model):
    with VideoGenerator.from_pretrained(tiny_model, executor="inline", offload="text", compact_text_padding=False) as g:
        assert g.engine.config.offload == "text" and g.engine.config.compact_text_padding is False
    with pytest.raises(ConfigError, match="no_such_option: not an engine option"):
        VideoGenerator.from_pretrained(tiny_model, executor="inline", no_such_option=1)


def test_distvideo_model_is_the_default_model(tiny_model, monkeypatch, tmp_path):
    from distvideo.executors.select import resolve_engine

    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(tiny_model, copy)
    monkeypatch.setenv("DISTVIDEO_MODEL", str(copy))
    assert resolve_engine(EngineConfig()).model.path == copy.resolve()
    monkeypatch.delenv("DISTVIDEO_MODEL")  # the suite sets it to the tiny model (conftest.py)
    from distvideo.models.embedded import embedded_model_path

    assert resolve_engine(EngineConfig()).model.path == embedded_model_path().resolve()
