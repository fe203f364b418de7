"""A Hugging Face repo id as `--model`, resolved offline from a cache laid out as huggingface_hub lays it out, and
downloaded once per node under a launcher when missing (the download itself is simulated: no network in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distvideo import ConfigError
from distvideo.models.hub import looks_like_repo_id, resolve_model
from distvideo.testing.hub_cache import write_hub_cache
from family_checkpoints import BUILD_FAMILY, family_checkpoint, test_image

from background import FolderJob, run_python
from conftest import REPO
from launchers import format_output, launcher_env, run_launcher

REPO_ID = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"


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
    """`distvideo generate --model REPO_ID` offline, on two ranks it spawns itself (mp executor, sp=2), with an image
    (which reaches the spawned ranks through the executor's pipes)."""
    import av

    snapshot = write_hub_cache(family_checkpoint(tmp_path_factory, "wan22_ti2v_5b"), tmp_path / "hub", REPO_ID)
    out = tmp_path / "v.mp4"
    cli = [sys.executable, "-m", "distvideo", "generate", "--model", REPO_ID, "--prompt", "a fox", "--steps", "1"]
    cli += ["--image", str(test_image(tmp_path_factory)), "--num-frames", "5", "--height", "64", "--width", "64"]
    cli += ["--num-gpus", "2", "--sp-size", "2", "--log-level", "DEBUG", "--output", str(out)]
    proc = subprocess.run(cli, env=_offline_env(tmp_path / "hub"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"the hub cache's snapshot {snapshot.resolve()}" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == 5 and container.streams.video[0].average_rate == 24


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


def _torchrun_launch(folder: Path, environ: dict[str, str]) -> tuple[Path, subprocess.CompletedProcess]:
    """On the family's checkpoint, built in a process of its own (the session's bytes, family_checkpoints.py)."""
    run_python(BUILD_FAMILY, [str(folder / "model"), "wan22_ti2v_5b"], environ)
    snapshot = write_hub_cache(folder / "model", folder / "remote", REPO_ID)
    script = REPO / "tests" / "rank_scripts" / "hub_download_ranks.py"
    env = {"HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(folder / "node-cache")}
    assert "HF_HUB_OFFLINE" in launcher_env(env, base=environ)
    argv = [str(script), REPO_ID, str(folder / "remote"), str(folder)]
    return snapshot, run_launcher("torchrun", argv, nproc=2, env=env, timeout=300, base=environ)


# a launch whose outcome is all the test checks: in the background (background.py)
TORCHRUN = FolderJob("a hub download under torchrun", "hub-torchrun", _torchrun_launch)
BACKGROUND_JOBS = {"torchrun_launch": TORCHRUN.hooks}


torchrun_launch = TORCHRUN.fixture("torchrun_launch")


@pytest.mark.launcher
@pytest.mark.slow
def test_one_download_per_node_under_torchrun(torchrun_launch):
    tmp_path, (snapshot, proc) = torchrun_launch
    assert proc.returncode == 0, format_output(proc)
    assert (tmp_path / "downloads.log").read_text().count("rank") == 1, "one rank downloads, the other waits"
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = str(tmp_path / "node-cache" / "models--Wan-AI--Wan2.2-TI2V-5B-Diffusers" / "snapshots" / snapshot.name)
    assert [r["model"] for r in reports] == [str(os.path.realpath(expected))] * 2
    assert [r["frames"] for r in reports] == [True, False]
