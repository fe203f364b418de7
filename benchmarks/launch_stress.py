"""Exit reliability: N consecutive 2-rank `torchrun ... -m distvideo generate` runs beside a CPU load, counting the
launches that exit non-zero.

A launch that wrote its video must also exit 0: a rank that aborts after its last log line (issue 26: "terminate
called without an active exception", exit -6, from a gloo thread alive at interpreter exit) makes torchrun fail the
job, and a cluster marks a good job failed. The race needs a starved thread, so the launches run beside one CPU
burner process per core (started before the first launch, stopped after the last). Each launch is checked: exit code,
exactly one video written, and the abort's message in its output; the output of every failed launch is kept.

    .venv/bin/python benchmarks/launch_stress.py                          # 50 launches, one burner per core
    .venv/bin/python benchmarks/launch_stress.py --launches 10 --burners 0 --json out.json --logs failed/

Prints one line per launch and a summary (launches, failures, exit codes seen, aborts, total time, load average);
`--json` also writes it with the machine, the command and the commit. Exit status 1 when any launch failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPT = "a red fox"
# the request of tests/test_external_launch.py's generate test: the two ranks split the CFG branches
REQUEST = ["--num-frames", "5", "--height", "32", "--width", "48", "--steps", "2", "--seed", "5"]
ABORT_TEXT = "terminate called without an active exception"
# torchrun's report of a failed rank: "failed (exitcode: -6) local_rank: 1 (pid: ...)"
RANK_FAILURE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# variables of an enclosing launcher or job, which would confuse the launched ranks
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_command(output: Path, nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",  # = torchrun
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        "-m",
        "distvideo",
        "generate",
        "--prompt",
        PROMPT,
        "--output",
        str(output),
        *REQUEST,
    ]


def launch_env(model: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARIABLES and not k.startswith(("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_"))
    }
    env.update(HF_HUB_OFFLINE="1", DISTVIDEO_MODEL=model, DISTVIDEO_NO_PROGRESS="1")
    if "GLOO_SOCKET_IFNAME" not in env and Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo otherwise resolves the hostname to pick an interface
    return env


def run_launch(index: int, model: str, nproc: int, timeout: float, logs: Path | None) -> dict[str, Any]:
    """One launch in a fresh folder: its exit code, the videos it left, the ranks torchrun reported failed."""
    with tempfile.TemporaryDirectory(prefix="distvideo-stress-") as scratch:
        output = Path(scratch) / "v.mp4"
        cmd = launch_command(output, nproc)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, env=launch_env(model), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:  # counted as a failure; subprocess.run has killed torchrun
            code, out, err = None, _text(exc.stdout), _text(exc.stderr) + f"\n(timed out after {timeout:g} s)"
        seconds = time.monotonic() - start
        videos = sorted(p.name for p in Path(scratch).iterdir())
    text = out + err
    result = {
        "launch": index,
        "exit_code": code,
        "seconds": round(seconds, 2),
        "videos": videos,
        "aborted": ABORT_TEXT in text,
        "failed_ranks": [{"local_rank": int(r), "exit_code": int(c)} for c, r in RANK_FAILURE.findall(text)],
    }
    result["ok"] = code == 0 and videos == ["v.mp4"]
    if not result["ok"] and logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"launch-{index:03d}.log").write_text(
            f"command: {' '.join(cmd)}\nexit code: {code}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
        )
    return result


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def start_burners(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` processes that each keep one core busy in a plain Python loop until stopped."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(count)
    ]


def stop_burners(burners: list[subprocess.Popen[bytes]]) -> None:
    for burner in burners:
        burner.send_signal(signal.SIGTERM)
    for burner in burners:
        try:
            burner.wait(timeout=10)
        except subprocess.TimeoutExpired:
            burner.kill()
            burner.wait()


def resolve_model(model: str | None) -> str:
    if model:
        return model
    from distvideo.models.embedded import tiny_model_path

    return str(tiny_model_path())


def machine() -> dict[str, Any]:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": cores,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def summarise(results: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    codes = collections.Counter(str(r["exit_code"]) for r in results)
    rank_codes = collections.Counter(
        f"local_rank {f['local_rank']}: {f['exit_code']}" for r in results for f in r["failed_ranks"]
    )
    return {
        "launches": len(results),
        "failures": sum(1 for r in results if not r["ok"]),
        "exit_codes": dict(sorted(codes.items())),
        "failed_ranks": dict(sorted(rank_codes.items())),
        "aborts": sum(1 for r in results if r["aborted"]),
        "total_s": round(seconds, 1),
        "median_launch_s": sorted(r["seconds"] for r in results)[len(results) // 2] if results else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=50, help="consecutive launches (default 50)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per launch (default 2)")
    parser.add_argument("--burners", type=int, default=None, help="CPU burner processes (default: one per core)")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the tiny random-weight model)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take (default 300)")
    parser.add_argument("--logs", type=Path, default=None, help="keep the output of every failed launch here")
    parser.add_argument("--json", default=None, help="also write the summary and every launch to this file")
    args = parser.parse_args(argv)

    model = resolve_model(args.model)
    info = machine()
    burner_count = info["cores"] if args.burners is None else args.burners
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": [Path(sys.executable).name, *sys.argv],
        "launch_command": " ".join(launch_command(Path("OUT/v.mp4"), args.nproc)),
        "machine": info,
        "model": model,
        "burners": burner_count,
        "loadavg_before": os.getloadavg(),
    }
    print(f"# {report['date']} commit {report['commit']}; machine {info}", flush=True)
    print(f"# load average before: {report['loadavg_before']}; {burner_count} burner(s)", flush=True)
    print(f"# each launch: {report['launch_command']}", flush=True)
    results: list[dict[str, Any]] = []
    burners = start_burners(burner_count)
    start = time.monotonic()
    try:
        for index in range(1, args.launches + 1):
            result = run_launch(index, model, args.nproc, args.timeout, args.logs)
            results.append(result)
            note = "" if result["ok"] else f"  FAILED: videos {result['videos']}, ranks {result['failed_ranks']}"
            if result["aborted"]:
                note += f" ({ABORT_TEXT!r})"
            print(f"launch {index}/{args.launches}: exit {result['exit_code']} in {result['seconds']:.1f} s{note}")
            sys.stdout.flush()
    finally:
        report["loadavg_with_load"] = os.getloadavg()
        stop_burners(burners)
    report["summary"] = summarise(results, time.monotonic() - start)
    report["results"] = results
    summary = report["summary"]
    print()
    print(
        f"{summary['launches']} launches, {summary['failures']} failed; exit codes {summary['exit_codes']}; "
        f"failed ranks {summary['failed_ranks'] or 'none'}; {summary['aborts']} with {ABORT_TEXT!r}; "
        f"{summary['total_s']:.0f} s in all (median launch {summary['median_launch_s']} s); load average before "
        f"{report['loadavg_before']}, at the end with the load {report['loadavg_with_load']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
