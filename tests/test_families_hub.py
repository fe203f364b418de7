"""A Hugging Face repo id as `--model`, resolved offline from a cache laid out as huggingface_hub lays it out, and
downloaded once per node under a launcher when missing (the download itself is simulated: no network in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from distvideo import ConfigError, VideoGenerator
from distvideo.models.hub import looks_like_repo_id, resolve_model
from distvideo.testing.hub_cache import write_hub_cache
from family_checkpoints import family_checkpoint, test_image

from conftest import REPO
from launchers import format_output, launcher_env, run_launcher

REPO_ID = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
SMALL = dict(num_frames=5, height=32, width=64, num_inference_steps=2, seed=2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", True),
        ("org/name", True),
        ("/abs/path", False),
        ("./rel/path", False),
        ("~/models/x", False),
        ("one", False),
        ("a/b/c", False),
        ("a/..", False),
    ],
)
def test_repo_id_shape(text, expected):
    assert looks_like_repo_id(text) is expected


def test_local_folders_are_left_alone(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/name") == "org/name"


def _offline_env(cache) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "DISTVIDEO_NO_PROGRESS": "1"}


@pytest.mark.slow
def test_repo_id_resolves_offline_from_the_hub_cache(tmp_path_factory, tmp_path):
    model = family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")
    snapshot = write_hub_cache(model, tmp_path / "hub", REPO_ID)
    image = test_image(tmp_path_factory)
    out = tmp_path / "frames.npy"
    code = (
        "import sys, numpy as np; from distvideo import VideoGenerator\n"
        f"with VideoGenerator.from_pretrained({REPO_ID!r}, executor='inline') as gen:\n"
        f"    res = gen.generate('a fox', image={str(image)!r}, save_video=False, **{SMALL!r})\n"
        f"    np.save({str(out)!r}, res.frames); print(gen.model_info.path)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_offline_env(tmp_path / "hub"), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(snapshot.resolve())
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        expected = gen.generate("a fox", image=str(image), save_video=False, **SMALL).frames
    assert np.array_equal(np.load(out), expected)
    # the command line takes it too
    cli = [sys.executable, "-m", "distvideo", "generate", "--model", REPO_ID, "--prompt", "a fox", "--steps", "1"]
    cli += ["--num-frames", "5", "--height", "32", "--width", "64", "--output", str(tmp_path / "v.mp4")]
    proc = subprocess.run(cli, env=_offline_env(tmp_path / "hub"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "v.mp4").is_file()


def test_repo_id_missing_from_the_cache_while_offline_exits_2(tmp_path):
    cli = [sys.executable, "-m", "distvideo", "generate", "--model", REPO_ID, "--prompt", "a fox"]
    proc = subprocess.run(cli, env=_offline_env(tmp_path / "empty-hub"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"--model {REPO_ID}: no such folder, and the repo is not in the Hugging Face cache" in proc.stderr
    assert "HF_HUB_OFFLINE" in proc.stderr


def test_in_process_offline_refusal_is_a_config_error(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        resolve_model("nobody/nothing")


@pytest.mark.launcher
@pytest.mark.slow
def test_one_download_per_node_under_torchrun(tmp_path_factory, tmp_path):
    model = family_checkpoint(tmp_path_factory, "wan22_ti2v_5b")
    snapshot = write_hub_cache(model, tmp_path / "remote", REPO_ID)
    script = REPO / "tests" / "rank_scripts" / "hub_download_ranks.py"
    env = {"HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path / "node-cache")}
    assert "HF_HUB_OFFLINE" in launcher_env(env)
    proc = run_launcher("torchrun", [str(script), REPO_ID, str(tmp_path / "remote"), str(tmp_path)], nproc=2,
                        env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, format_output(proc)
    assert (tmp_path / "downloads.log").read_text().count("rank") == 1, "one rank downloads, the other waits"
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = str(tmp_path / "node-cache" / "models--Wan-AI--Wan2.2-TI2V-5B-Diffusers" / "snapshots" / snapshot.name)
    assert [r["model"] for r in reports] == [str(os.path.realpath(expected))] * 2
    assert [r["frames"] for r in reports] == [True, False]
