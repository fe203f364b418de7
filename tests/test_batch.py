"""Batch jobs (issue 16): prompt files over data-parallel replicas, resumable, on every executor and launcher."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import distvideo.worker
from distvideo import VideoGenerator
from distvideo.batch import derive_seed, read_prompt_file
from distvideo.batch.assign import assign
from distvideo.batch.items import BatchItem, build_items, fingerprint
from distvideo.batch.manifest import Manifest
from distvideo.cli.main import main
from distvideo.config import EngineConfig
from distvideo.errors import ConfigError
from distvideo.executors import mp, resolve_engine
from distvideo.parallel.layout import resolve_layout
from distvideo.request import GenerationRequest
from launch_groups import torchrun_case

from background import FolderJob
from launchers import format_output, local_slurm, run_launcher  # noqa: F401

SMALL = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2", "--no-progress"]
PROMPTS = ["a red fox", "a blue boat", "a green tree in the wind", "a yellow kite"]
RESUMED = [*PROMPTS, "a white swan"]
# valid for the model (sides <= 8192, frames <= 4097), but terabytes of activations: refused when it runs
TOO_BIG = {"num_frames": 4097, "height": 8192, "width": 8192}


def write_prompts(folder: Path, prompts=PROMPTS, name: str = "prompts.txt") -> Path:
    path = folder / name
    path.write_text("\n".join(prompts) + "\n")
    return path


def videos(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.mp4"))}


def manifest(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]


@pytest.fixture
def no_loading(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("model weights were loaded although nothing was left to do")

    monkeypatch.setattr(distvideo.worker, "load_components", tripwire)


# --- items, seeds, assignment (pure) ----------------------------------------------------------------------------------
def test_prompt_files_plain_and_jsonl(tmp_path):
    assert read_prompt_file(write_prompts(tmp_path, ["one", "", "two"])) == [{"prompt": "one"}, {"prompt": "two"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a", "seed": 3}\nnot json\n[1, 2]\n{"prompt": "b", "height": 64}\n')
    items = read_prompt_file(jsonl)
    assert items[0] == {"prompt": "a", "seed": 3} and items[3] == {"prompt": "b", "height": 64}
    assert "line 2: not JSON" in items[1]["_error"] and "expected a JSON object" in items[2]["_error"]
    with pytest.raises(ConfigError, match="holds no prompt"):
        read_prompt_file(write_prompts(tmp_path, [""], name="empty.txt"))
    with pytest.raises(ConfigError, match="cannot read"):
        read_prompt_file(tmp_path / "missing.txt")


def test_seeds_depend_on_the_batch_seed_and_index_only():
    """The seed a run records must be the one the run that resumes it derives: the same in another process (no
    str hash, no global random state), different for another batch seed or index."""
    code = "from distvideo.batch import derive_seed; print(derive_seed(0, 5), derive_seed(1, 5))"
    elsewhere = subprocess.check_output([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": "random"})
    assert [int(seed) for seed in elsewhere.split()] == [derive_seed(0, 5), derive_seed(1, 5)]
    assert derive_seed(0, 5) != derive_seed(1, 5) != derive_seed(1, 6)
    assert 0 <= derive_seed(7, 123456) < 2**63


def test_items_resolve_or_keep_their_error(tiny_model):
    model = resolve_engine(EngineConfig(model=str(tiny_model))).model
    defaults = GenerationRequest(prompt="-", num_frames=5, height=32, width=48, num_inference_steps=2)
    raw = ["plain", {"prompt": "seeded", "seed": 9}, {"prompt": "bad", "height": 50}, {"prompt": "x", "colour": 1}]
    items = build_items(raw, model, defaults=defaults, batch_seed=4)
    assert items[0].request.seed == derive_seed(4, 0) and items[1].request.seed == 9
    assert "height=50" in items[2].error and "unknown key" in items[3].error
    changed = build_items(["plain", {"prompt": "seeded", "seed": 10}], model, defaults=defaults, batch_seed=4)
    assert changed[0].fingerprint == items[0].fingerprint and changed[1].fingerprint != items[1].fingerprint
    assert fingerprint(items[0].request) == items[0].fingerprint


def test_assignment_is_deterministic_and_balanced_by_cost():
    def item(index: int, frames: int) -> BatchItem:
        request = GenerationRequest(prompt="x", num_frames=frames, height=64, width=64, num_inference_steps=10)
        return BatchItem(index=index, fields={}, request=request)

    items = [item(0, 81), item(1, 5), item(2, 5), item(3, 5), item(4, 81), item(5, 5)]
    shares = assign(items, 2)
    assert shares == assign(list(reversed(items)), 2)  # deterministic: not by input order
    loads = [sum(i.cost for i in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= item(9, 5).cost  # the two long items on different replicas
    assert {0, 4} & {i.index for i in shares[0]} and {0, 4} & {i.index for i in shares[1]}
    assert all([i.index for i in share] == sorted(i.index for i in share) for share in shares)


def test_replicas_in_the_layout():
    layout = resolve_layout(8, replicas=2, sp_size=2, cfg_parallel=True)
    assert layout.describe() == "world 8 = replicas 2 x cfg 2 x sp 2" and layout.output_ranks() == [0, 4]
    assert resolve_layout(4, sp_size=1, cfg_parallel=False).replicas == 4  # derived when cfg and sp are fixed
    with pytest.raises(ConfigError, match=r"replicas\(3\) must divide world_size\(4\)"):
        resolve_layout(4, replicas=3)


# --- the command, inline ----------------------------------------------------------------------------------------------
def test_a_batch_resumes_and_redoes_only_what_changed_or_is_gone(tmp_path, monkeypatch, capsys):
    prompts, out = write_prompts(tmp_path, RESUMED), tmp_path / "out"
    argv = ["generate", "--prompts", str(prompts), "--output", str(out), "--executor", "inline", *SMALL]
    assert main(argv) == 0
    first = videos(out)
    assert len(first) == 5 and [r["index"] for r in manifest(out)] == [0, 1, 2, 3, 4]
    assert "5 done (0 from earlier runs), 0 failed, of 5" in capsys.readouterr().out

    # nothing left: no weights are loaded, nothing is written
    with monkeypatch.context() as m:
        m.setattr(distvideo.worker, "load_components", lambda *a, **k: pytest.fail("loaded weights"))
        assert main(argv) == 0
    assert len(manifest(out)) == 5 and videos(out) == first
    assert "5 done (5 from earlier runs)" in capsys.readouterr().out

    # a changed prompt, a deleted video, a truncated one and one damaged at the same size (only its sha256 tells)
    # are redone; the untouched one is not
    write_prompts(tmp_path, [RESUMED[0], "a blue boat at dawn", *RESUMED[2:]])
    names = sorted(first)
    untouched = (out / names[0]).stat()
    (out / names[2]).unlink()
    (out / names[3]).write_bytes((out / names[3]).read_bytes()[:100])
    damaged = bytearray((out / names[4]).read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (out / names[4]).write_bytes(bytes(damaged))
    assert main(argv) == 0
    redone = [r["index"] for r in manifest(out)[5:]]
    assert sorted(redone) == [1, 2, 3, 4]
    after = videos(out)
    assert after[names[0]] == first[names[0]] and (out / names[0]).stat().st_mtime_ns == untouched.st_mtime_ns
    # the same item gives the same video: the deleted, truncated and damaged ones come back as they were
    assert [after[n] for n in names[2:]] == [first[n] for n in names[2:]]
    changed = next(r for r in manifest(out)[5:] if r["index"] == 1)
    assert changed["prompt"] == "a blue boat at dawn" and changed["video"] not in first and changed["video"] in after


def test_failed_items_are_recorded_and_the_batch_goes_on(tmp_path, capsys):
    """Refused when planned (a height the model cannot take) or when run (every item passes the model's checks, but
    the memory check refuses this one on its replica before any step): recorded as failed with the reason, and the
    items after it still run."""
    jsonl = tmp_path / "p.jsonl"
    lines = [{"prompt": "fine"}, {"prompt": "too odd", "height": 50}, {"prompt": "far too big", **TOO_BIG}]
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in [*lines, {"prompt": "also fine"}]))
    out = tmp_path / "out"
    argv = ["generate", "--prompts", str(jsonl), "--output", str(out), "--executor", "inline", *SMALL]
    assert main(argv) == 1
    records = {r["index"]: r for r in manifest(out)}
    assert records[1]["status"] == "failed" and "height=50" in records[1]["error"]
    assert records[2]["status"] == "failed", records[2]
    assert records[2]["error"].startswith("ConfigError: the request (4097 frames of 8192x8192) needs"), records[2]
    assert records[0]["status"] == records[3]["status"] == "done"
    assert [r["index"] for r in manifest(out)] == [1, 0, 2, 3], "the refused item must not end the batch"
    assert "2 done (0 from earlier runs), 2 failed, of 4" in capsys.readouterr().out


def test_the_batch_log_counts_the_items_done(tmp_path, monkeypatch):
    """With --no-progress (a Slurm log) every finished item logs a line with the count so far (it said 0 until the
    end: a disabled tqdm bar counts nothing). Items without a seed get theirs from --batch-seed and their index."""
    out = tmp_path / "out"
    argv = ["generate", "--prompts", str(write_prompts(tmp_path, PROMPTS[:3])), "--output", str(out), *SMALL]
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("distvideo.batch.run")
    log.addHandler(handler)
    try:
        assert main([*argv, "--executor", "inline", "--batch-seed", "7"]) == 0
    finally:
        log.removeHandler(handler)
    counts = [m.split(" items done")[0] for m in messages if " items done (" in m]
    assert counts == ["batch: 1 of 3", "batch: 2 of 3", "batch: 3 of 3"]
    seeds = [r["seed"] for r in sorted(manifest(out), key=lambda r: r["index"])]
    assert seeds == [derive_seed(7, i) for i in range(3)] and seeds != [derive_seed(0, i) for i in range(3)]
    assert {name.rsplit("_seed", 1)[1] for name in videos(out)} == {f"{seed}.mp4" for seed in seeds}
    # the same batch seed again: the same seeds, so nothing is left to do (no weights load)
    monkeypatch.setattr(distvideo.worker, "load_components", lambda *a, **k: pytest.fail("loaded weights"))
    assert main([*argv, "--executor", "inline", "--batch-seed", "7"]) == 0 and len(manifest(out)) == 3


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--prompt", "x"], "--prompt and --prompts"),
        (["--output", "v.mp4"], "is a folder"),
        # an item without a seed gets one from --batch-seed: a single seed would be ignored without a word
        (["--seed", "5"], "--seed 5 with --prompts: item 0 has no seed of its own, and a batch item gets it from"),
        (["--config", "{seeded}"], "seeded.yaml: 'request.seed' with --prompts: item 0 has no seed of its own"),
    ],
    ids=["with-prompt", "mp4-output", "with-seed", "with-config-seed"],
)
def test_bad_batch_arguments_exit_2(tmp_path, extra, named, no_loading, capsys):
    prompts = write_prompts(tmp_path)
    (tmp_path / "seeded.yaml").write_text("request:\n  seed: 5\n")
    extra = [arg.format(seeded=tmp_path / "seeded.yaml") for arg in extra]
    argv = ["generate", "--prompts", str(prompts), "--output", str(tmp_path / "out"), *SMALL]
    assert main([*argv, *extra]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "nothing may be written"


def test_the_config_files_output_path_is_the_batch_folder(tmp_path, monkeypatch, no_loading, capsys):
    """Without --output, a batch's folder is the config file's request.output_path, checked as --output is (before,
    the batch went to ./outputs and the file's value was ignored without a word)."""
    prompts = write_prompts(tmp_path)
    (tmp_path / "conf.yaml").write_text(f"request:\n  output_path: {tmp_path / 'wanted.mp4'}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--prompts", str(prompts), "--config", str(tmp_path / "conf.yaml"), *SMALL]) == 2
    assert f"--output {tmp_path / 'wanted.mp4'}: with --prompts, --output is a folder" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "wanted.mp4").exists()


def test_generate_batch_returns_results_in_input_order(tmp_path):
    with VideoGenerator.from_pretrained(executor="inline") as gen:
        items = ["one", {"prompt": "two", "seed": 5}, {"prompt": "bad", "width": 50}]
        results = gen.generate_batch(
            items, output_dir=tmp_path, num_frames=5, height=32, width=48, num_inference_steps=2, return_frames=True
        )
    assert [r.index for r in results] == [0, 1, 2]
    assert [r.status for r in results] == ["done", "done", "failed"]
    assert results[1].seed == 5 and Path(results[1].video_path).is_file() and results[1].frames.shape == (5, 32, 48, 3)
    assert "width=50" in results[2].error


# --- every executor and launcher gives the same files ----------------------------------------------------------------
@pytest.fixture(scope="module")
def inline_videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inline")
    prompts = write_prompts(folder)
    assert (
        main(["generate", "--prompts", str(prompts), "--output", str(folder / "out"), "--executor", "inline", *SMALL])
        == 0
    )
    return videos(folder / "out")


def kill_rank_1_after_the_first_record(monkeypatch) -> list[int]:
    """From now on, the first manifest line written (world rank 0, as an item finished) is followed at once by a
    SIGKILL of the mp executor's rank 1 worker, started after this call; returns the killed pids."""
    before, append, killed = set(mp._LIVE), Manifest.append, []

    def append_then_kill(self, record):
        append(self, record)
        if not killed:
            (executor,) = set(mp._LIVE) - before
            killed.append(executor._procs[1].pid)
            os.kill(killed[0], signal.SIGKILL)

    monkeypatch.setattr(Manifest, "append", append_then_kill)
    return killed


def kept_files(folder: Path, names) -> dict[str, tuple[str, int, int]]:
    return {n: (hashlib.sha256((folder / n).read_bytes()).hexdigest(), *_stamp(folder / n)) for n in names}


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_ino


@pytest.mark.slow
def test_mp_replicas_resume_after_a_dead_rank_and_write_the_same_files(tmp_path, monkeypatch, capsys, inline_videos):
    """2 spawned replicas; rank 1's worker is SIGKILLed as soon as the first item is recorded: the job ends (exit 1)
    with nothing half-written. The same command again runs only the items not done, leaves the finished items'
    files as they were (bytes, mtime, inode), and every file is the one the inline run writes."""
    prompts, out = write_prompts(tmp_path), tmp_path / "out"
    argv = ["generate", "--prompts", str(prompts), "--output", str(out), "--num-gpus", "2", "--replicas", "2", *SMALL]
    with monkeypatch.context() as m:
        killed = kill_rank_1_after_the_first_record(m)
        assert main(argv) == 1
    assert killed, "no item was recorded before the job ended"
    assert "WorkerDiedError: rank 1 died (killed by SIGKILL)" in capsys.readouterr().err
    first = manifest(out)
    done = {r["index"]: r["video"] for r in first if r["status"] == "done"}
    assert len(first) == len(done) and 1 <= len(done) < 4, first
    assert sorted(p.name for p in out.iterdir()) == sorted([*done.values(), "manifest.jsonl"]), "a partial file"
    kept = kept_files(out, done.values())

    assert main(argv) == 0
    assert f"4 done ({len(done)} from earlier runs), 0 failed, of 4" in capsys.readouterr().out
    assert sorted(r["index"] for r in manifest(out)[len(first) :]) == sorted(set(range(4)) - set(done))
    assert kept_files(out, done.values()) == kept, "a finished item's file was touched"
    assert videos(out) == inline_videos
    assert {r["replica"] for r in manifest(out)} == {0, 1}


LAUNCH_PARAMS = [
    pytest.param("torchrun", id="torchrun"),
    pytest.param("srun", id="srun", marks=pytest.mark.slurm),
    pytest.param("mpirun", id="mpirun", marks=pytest.mark.mpi),
]


def _batch_argv(folder: Path, environ: dict[str, str] | None = None) -> list[str]:
    prompts, out = write_prompts(folder), folder / "out"
    return ["-m", "distvideo", "generate", "--prompts", str(prompts), "--output", str(out), "--replicas", "2", *SMALL]


def _launch_batch(launcher: str, folder: Path, base: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_launcher(launcher, _batch_argv(folder), nproc=2, timeout=300, base=base)


# torchrun's and mpirun's launches, whose outcome is all the test checks: in the background (background.py), torchrun's
# in turn with other modules' scripts of 2 ranks (launch_groups.py); srun's in the test (a job never uses the session's
# Slurm)
LAUNCHED = {
    "torchrun": torchrun_case("batch replicas under torchrun", 2, _batch_argv, timeout=300),
    "mpirun": FolderJob("batch replicas under mpirun", "batch-mpirun", functools.partial(_launch_batch, "mpirun")),
}
BACKGROUND_JOBS = {f"launched_batch[{launcher}]": job.hooks for launcher, job in LAUNCHED.items()}


@pytest.fixture
def launched_batch(launcher: str, tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    if launcher in LAUNCHED:
        return LAUNCHED[launcher].result()
    return tmp_path, _launch_batch(launcher, tmp_path)


@pytest.mark.launcher
@pytest.mark.parametrize("launcher", LAUNCH_PARAMS)
def test_launched_replicas_write_the_same_files_and_one_manifest(launcher, launched_batch, inline_videos):
    """Each replica's output rank writes its videos; world rank 0 writes every manifest line (the other replica's
    arrive through the rendezvous store)."""
    folder, proc = launched_batch
    out = folder / "out"
    assert proc.returncode == 0, format_output(proc)
    assert videos(out) == inline_videos
    records = manifest(out)
    assert sorted(r["index"] for r in records) == [0, 1, 2, 3] and {r["replica"] for r in records} == {0, 1}
    assert proc.stdout.count("batch: 4 done") == 1, "only world rank 0 prints the summary"
