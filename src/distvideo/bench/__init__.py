"""`distvideo bench`, a package: the plan (plan.py), the measurements (measure.py), diffusers as the reference in a
child process (baseline.py), the report (report.py) and the loop that ties them (run.py).

The names below are imported at first use: the CLI builds `bench`'s arguments from plan.py alone, so that a command
refused for bad input (or `--help`) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distvideo.bench.plan import BenchPlan, add_bench_parser, plan_from_args
    from distvideo.bench.report import format_report, write_json
    from distvideo.bench.run import cmd_bench, run_bench

_WHERE = {
    "BenchPlan": "plan",
    "add_bench_parser": "plan",
    "plan_from_args": "plan",
    "format_report": "report",
    "write_json": "report",
    "cmd_bench": "run",
    "run_bench": "run",
}
__all__ = ["BenchPlan", "add_bench_parser", "cmd_bench", "format_report", "plan_from_args", "run_bench", "write_json"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"distvideo.bench.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'distvideo.bench' has no attribute {name!r}")
