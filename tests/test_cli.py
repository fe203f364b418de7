"""The `distvideo generate` command end to end: a decodable mp4, exit codes, and bad input refused early."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distvideo.cli.main import main
from distvideo.errors import ConfigError

from conftest import read_video

SMALL = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2"]


def test_generate_writes_playable_mp4(tmp_path, tiny_model):
    out = tmp_path / "clip.mp4"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "distvideo",
            "generate",
            "--prompt",
            "a fox",
            "--output",
            str(out),
            "--no-progress",
            *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    # only what the user can act on reaches the terminal: distvideo's own summary, no library's notices (transformers
    # warned about torchvision for SigLIP, a HunyuanVideo 1.5 image encoder, on every Wan run)
    assert [line for line in proc.stderr.splitlines() if " distvideo." not in line] == [], proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    frames, codec, pix_fmt = read_video(out)
    assert frames.shape == (5, 32, 48, 3)
    assert (codec, pix_fmt) == ("h264", "yuv420p")
    assert list(tmp_path.iterdir()) == [out], "a temporary file was left beside the video"


def test_output_folder_names_file_from_prompt_and_never_overwrites(tmp_path, capsys):
    args = ["generate", "--prompt", "A Cat, on a Boat!", "--output", str(tmp_path / "vids"), *SMALL, "--seed", "4"]
    assert main(args) == 0
    assert main(args) == 0
    printed = capsys.readouterr().out.split()
    assert [Path(p).name for p in printed] == ["a_cat_on_a_boat_seed4.mp4", "a_cat_on_a_boat_seed4_1.mp4"]
    assert sorted(p.name for p in (tmp_path / "vids").iterdir()) == sorted(Path(p).name for p in printed)


# each message names the flag as typed, with the value seen (not the Python keyword: issue 55)
BAD_INPUTS = [
    (["--height", "50"], "--height 50 must be a multiple of 16"),
    (["--width", "40"], "--width 40"),
    (["--num-frames", "10"], "--num-frames 10"),
    (["--steps", "0"], "--steps 0 must be >= 1"),
    (["--num-inference-steps", "0"], "--num-inference-steps 0 must be >= 1"),
    (["--guidance-scale", "-1"], "--guidance-scale -1.0"),
    (["--prompt", "  "], "--prompt"),
    (["--model", "/nonexistent/model"], "--model"),
    (["--executor", "inline", "--num-gpus", "2"], "--executor inline runs one rank; --num-gpus 2 needs --executor mp"),
    (["--device", "banana"], "--device banana is not a device"),
    (["--device", "cuda:x"], "--device cuda:x is not a device"),
    (["--lora", "/nonexistent/style.safetensors:0.5"], "LoRA file '/nonexistent/style.safetensors' does not exist"),
]


@pytest.mark.parametrize(("extra", "named"), BAD_INPUTS, ids=[n for _, n in BAD_INPUTS])
@pytest.mark.usefixtures("no_weights_loaded")
def test_bad_input_exits_2_naming_parameter_before_model_work(extra, named, tmp_path, capsys):
    out = tmp_path / "never.mp4"
    args = ["generate", "--prompt", "a fox", "--output", str(out), "--num-frames", "5", "--height", "32"]
    args += ["--width", "32", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert named in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("no_weights_loaded")
def test_folder_that_is_not_a_checkpoint_exits_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path / "empty")]) == 2
    assert "model_index.json" in capsys.readouterr().err


@pytest.mark.usefixtures("no_weights_loaded")
def test_unknown_model_class_lists_supported(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "FluxPipeline" in err and "WanPipeline" in err


def test_bad_input_real_process_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "distvideo", "generate", "--prompt", "x", "--num-frames", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "--num-frames 8" in proc.stderr and "4k+1" in proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_failure_during_encoding_leaves_no_partial_video_and_keeps_the_frames(tmp_path, capsys, monkeypatch):
    import distvideo.media

    def broken_encoder(frames, file, fps):
        file.write(b"\x00" * 1000)  # a partial file, as a crash mid-encode would leave
        raise OSError("disk full (injected)")

    monkeypatch.setattr(distvideo.media, "_encode_mp4", broken_encoder)
    out = tmp_path / "clip.mp4"
    assert main(["generate", "--prompt", "x", "--output", str(out), *SMALL]) == 1
    err = capsys.readouterr().err
    assert "disk full" in err and "clip.frames.npy" in err
    assert [p.name for p in tmp_path.iterdir()] == ["clip.frames.npy"]  # no partial video; the frames are kept


NO_TORCH_PROBE = """
import sys
from distvideo.cli.main import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "diffusers", "transformers", "fastapi") if m in sys.modules)
print(code, ",".join(heavy) or "none")
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "x", "--steps", "-1"],
        ["generate", "--prompt", "x", "--height", "33"],
        ["serve", "--port", "-5"],
        ["bench", "--steps", "0"],
        ["calibrate", "--steps", "0"],
        ["generate", "--prompt", "x", "--device", "banana"],
        ["generate", "--prompt", "x", "--lora", "/nonexistent/style.safetensors"],
        ["bench", "--lora", "/nonexistent/style.safetensors"],
        ["generate", "--help"],
    ],
    ids=[
        *("generate-steps", "generate-height", "serve-port", "bench-steps", "calibrate-steps", "generate-device"),
        *("generate-lora", "bench-lora", "help"),
    ],
)
def test_bad_input_and_help_exit_before_torch_is_imported(argv):
    """A refused command answers in a fraction of a second: it checks its input before it imports torch, diffusers,
    transformers or FastAPI (about 2-4 s of imports on a laptop)."""
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_PROBE, *argv], capture_output=True, text=True, timeout=60)
    code, heavy = proc.stdout.strip().splitlines()[-1].split()
    assert heavy == "none", (argv, heavy, proc.stderr)
    assert int(code) == (0 if "--help" in argv else 2), proc.stderr


@pytest.mark.usefixtures("no_weights_loaded")
def test_an_output_folder_that_cannot_be_made_exits_2_before_loading(capsys):
    """As root `os.access` says yes to /sys; making the folder there fails. Refused before loading, naming --output."""
    assert main(["generate", "--prompt", "x", "--output", "/sys/distvideo_out/", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "--output '/sys/distvideo_out/" in err and "not writable" in err, err
    assert not Path("/sys/distvideo_out").exists()


def test_the_output_check_leaves_nothing_behind_but_a_batchs_folder(tmp_path):
    """The folder is made and a file created in it, and both are removed again (a run that fails later leaves
    nothing); a batch, whose ranks all check its folder at once, keeps the folder (and never a probe file)."""
    from distvideo.paths import check_output_target

    check_output_target(tmp_path / "a" / "b" / "clip.mp4")
    assert list(tmp_path.iterdir()) == []
    check_output_target(tmp_path / "a" / "b" / "manifest.jsonl", keep_folder=True)
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == ["a", "a/b"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not a folder"):
        check_output_target(tmp_path / "file" / "c" / "clip.mp4")


def test_a_video_that_cannot_be_written_nor_kept_says_the_frames_are_lost(tmp_path, capsys, monkeypatch):
    """The API keeps the frames on the error (`.frames`); a command ends with its process, so it says they are lost
    instead of pointing at a Python attribute."""
    import distvideo.media

    def broken(*args, **kwargs):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(distvideo.media, "_encode_mp4", broken)
    monkeypatch.setattr(distvideo.media, "write_array", broken)
    assert main(["generate", "--prompt", "x", "--output", str(tmp_path / "clip.mp4"), *SMALL]) == 1
    err = capsys.readouterr().err
    assert "disk full" in err and "the frames are lost" in err and ".frames)" not in err, err


@pytest.mark.usefixtures("no_weights_loaded")
def test_calibrate_refuses_a_model_shipped_in_the_package(capsys):
    """Its ratios file is part of the installed package: calibrate would rewrite a tracked file."""
    from distvideo.models.embedded import DEMO_MODEL_DIR

    assert main(["calibrate", "--model", str(DEMO_MODEL_DIR), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert f"--model {DEMO_MODEL_DIR}" in err and "shipped inside the distvideo package" in err and "cp -r" in err


def test_a_prompt_outside_the_demo_models_grammar_is_warned_about(tmp_path):
    """The demo model draws an arbitrary blob for a prompt outside its grammar: the run says so, naming the grammar;
    a caption of the grammar gets no warning."""
    import logging

    from distvideo.models.embedded import DEMO_EXAMPLE_PROMPT, DEMO_MODEL_DIR

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("distvideo")
    logger.addHandler(handler)
    try:
        for prompt in ("a red fox running through snow", DEMO_EXAMPLE_PROMPT):
            argv = ["generate", "--model", str(DEMO_MODEL_DIR), "--prompt", prompt, "--output", str(tmp_path), *SMALL]
            assert main([*argv, "--height", "32", "--width", "32"]) == 0
    finally:
        logger.removeHandler(handler)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "'a red fox running through snow'" in warned[0]
    assert "a {red|green|blue|yellow|white} {ball|square|triangle} moving {left|right|up|down}" in warned[0]


def test_the_summary_line_says_what_ran():
    from distvideo.outputs import run_summary

    timings = {"denoising": 3.0, "compile": 2.5, "decoding": 1.0}
    cache = {"method": "mag", "computed_steps": 6, "skipped_steps": [3, 5]}
    assert run_summary(timings, cache) == (
        "denoising 3.00 s, of which compiling 2.50 s, decoding 1.00 s, cache mag: skipped 2 of 8 steps [3, 5]"
    )
    assert run_summary({"denoising": 1.0, "decoding": 0.5}, None) == "denoising 1.00 s, decoding 0.50 s"
