"""`distvideo plan`: the layout the engine would choose, the alternatives and why; bad input exits 2 naming the option,
before torch is imported or any weight is read; `--layout` as a flag and a config key."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distvideo.cli.main import main
from distvideo.config import EngineConfig
from distvideo.executors import resolve_engine


def test_plan_prints_the_choice_the_alternatives_and_why(capsys):
    assert main(["plan", "--num-gpus", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "chosen (latency): cfg 2 x ulysses 2 x ring 1: est." in out
    assert "as flags: --replicas 1 --cfg-parallel --ulysses-size 2 --ring-size 1 --shard-weights none" in out
    assert "layout" in out and "ms/step" in out and "memory/rank" in out and "feasible" in out
    rows = [line for line in out.splitlines() if line.startswith(("*", " cfg", " replicas"))]
    assert rows[0].startswith("*cfg 2 x ulysses 2 x ring 1") and len(rows) > 3
    assert "\nwhy:\n" in out and "guided (two branches)" in out


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_plan_says_what_the_engine_runs(world, capsys):
    assert main(["plan", "--num-gpus", str(world), "--device", "cpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layout = resolve_engine(EngineConfig(num_gpus=world, executor="mp", device="cpu"), environ={}).layout
    chosen = plan["chosen"]
    assert (chosen["cfg"], chosen["ulysses"], chosen["ring"], chosen["replicas"]) == (
        layout.cfg_degree,
        layout.ulysses_size,
        layout.ring_size,
        layout.replicas,
    )
    assert plan["world"] == world and len(plan["candidates"]) >= 1 and plan["reasons"]


def test_a_quantized_plan_holds_the_weights_in_one_byte_and_never_shards(capsys):
    args = ["plan", "--num-gpus", "4", "--device", "cuda", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--quantize", "int8"]) == 0
    quantized = json.loads(capsys.readouterr().out)
    assert quantized["chosen"]["memory_per_rank_bytes"] < plain["chosen"]["memory_per_rank_bytes"]
    assert {c["shard"] for c in plain["candidates"]} > {"none"} == {c["shard"] for c in quantized["candidates"]}


def test_plan_across_nodes_and_for_throughput(capsys):
    args = ["plan", "--num-gpus", "8", "--nodes", "2", "--device", "cuda", "--memory-gib", "80"]
    assert main([*args, "--json", "--height", "480", "--width", "832", "--num-frames", "81"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["nodes"] == 2 and plan["hardware"]["ranks_per_node"] == 4
    assert plan["request"] == {"num_frames": 81, "height": 480, "width": 832, "guidance_scale": 5.0}
    assert main([*args, "--objective", "throughput", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]["replicas"] > 1  # the tiny model: replicas pay


BAD = [
    (["--num-gpus", "0"], "--num-gpus 0"),
    (["--num-gpus", "8", "--nodes", "3"], "--nodes 3"),
    (["--num-gpus", "2", "--memory-gib", "0"], "--memory-gib 0"),
    (["--num-gpus", "2", "--height", "33"], "--height 33"),
    (["--num-gpus", "2", "--num-frames", "8"], "--num-frames 8"),
    (["--num-gpus", "2", "--model", "/nonexistent/model"], "--model"),
    (["--num-gpus", "2", "--objective", "fastest"], "--objective"),
    ([], "--num-gpus"),
]


@pytest.mark.parametrize(("argv", "named"), BAD, ids=[n for _, n in BAD])
@pytest.mark.usefixtures("no_weights_loaded")
def test_bad_input_exits_2_naming_the_option(argv, named, capsys):
    assert main(["plan", *argv]) == 2
    assert named in capsys.readouterr().err


NO_TORCH_PROBE = """
import sys
from distvideo.cli.main import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "diffusers", "transformers", "fastapi") if m in sys.modules)
print(code, ",".join(heavy) or "none")
"""


@pytest.mark.parametrize(
    ("argv", "code"),
    [(["plan", "--num-gpus", "4"], 0), (["plan", "--num-gpus", "4", "--nodes", "3"], 2)],
    ids=["plan", "bad-nodes"],
)
def test_plan_never_imports_torch(argv, code):
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_PROBE, *argv], capture_output=True, text=True, timeout=60)
    got, heavy = proc.stdout.strip().splitlines()[-1].split()
    assert (int(got), heavy) == (code, "none"), proc.stderr


def test_layout_flag_and_config_key(tmp_path, capsys):
    from distvideo.cli.arguments import engine_config_from_args
    from distvideo.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--layout", "rules"])
    assert engine_config_from_args(args)[0].layout == "rules"
    assert engine_config_from_args(parser.parse_args(["generate", "--prompt", "x"]))[0].layout == "auto"
    config = tmp_path / "engine.yaml"
    config.write_text("engine:\n  layout: rules\n")
    assert engine_config_from_args(parser.parse_args(["generate", "--config", str(config)]))[0].layout == "rules"
    config.write_text("engine:\n  layout: fastest\n")
    assert main(["generate", "--prompt", "x", "--config", str(config)]) == 2
    assert "layout='fastest' is not supported; choose one of auto, rules" in capsys.readouterr().err


def test_a_latency_plan_compares_one_request_and_says_what_each_column_is(capsys):
    """The demo model on 8 GPUs over 2 nodes: one request on a replica of 2 ranks (replicas 4 x cfg 2) is estimated
    faster than on all 8, which the latency objective cannot choose (one request runs on every rank). The table lists
    what the objective may choose first, marks the replica rows as not for latency, says what each figure is, and the
    reasons name the smaller world that serves one request faster."""
    args = ["plan", "--num-gpus", "8", "--nodes", "2", "--device", "cuda", "--memory-gib", "80"]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan["columns"]) >= {"time_per_step_s", "steps_per_second", "memory_per_rank_bytes", "eligible"}
    eligible = [c for c in plan["candidates"] if c["eligible"]]
    assert eligible and all(c["replicas"] == 1 and c["feasible"] for c in eligible)
    assert plan["chosen"]["time_per_step_s"] == min(c["time_per_step_s"] for c in eligible)
    faster = min((c for c in plan["candidates"] if c["feasible"]), key=lambda c: c["time_per_step_s"])
    assert faster["replicas"] > 1 and faster["time_per_step_s"] < plan["chosen"]["time_per_step_s"]
    assert any(f"one request would run faster on {faster['cfg'] * faster['sp']} ranks" in r for r in plan["reasons"])

    assert main(args) == 0
    out = capsys.readouterr().out
    assert "ms/step: one request's denoising step on one replica's ranks; steps/s: all replicas busy" in out
    rows = [line for line in out.splitlines() if line.startswith(("*", " cfg", " replicas"))]
    kinds = ["replicas" in row for row in rows]
    assert kinds == sorted(kinds), "a row the objective may not choose is listed before one it may"
    assert all("not for latency" in row for row in rows if "replicas" in row)
    assert "device figures: cuda figures (--device cuda)" in out


def test_plan_says_where_its_device_figures_come_from(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever this machine has
    assert main(["plan", "--num-gpus", "4", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "cpu figures because no GPU found on this machine; --device cuda plans for the other kind" in out
    assert "so --nodes changes no CPU estimate" in out


def test_output_to_a_closed_pipe_ends_quietly():
    """`distvideo plan --json | true`: the reader is gone before plan writes. As Unix tools do, the command ends
    quietly (no BrokenPipeError, no traceback), with SIGPIPE's exit status 141."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "distvideo", "plan", "--num-gpus", "4", "--json"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")
