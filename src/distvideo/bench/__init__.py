"""`distvideo bench`, a package: the plan (plan.py), the measurements (measure.py), diffusers as the reference in a
child process (baseline.py), the report (report.py) and the loop that ties them (run.py)."""

from distvideo.bench.plan import BenchPlan, add_bench_parser, plan_from_args
from distvideo.bench.report import format_report, write_json
from distvideo.bench.run import cmd_bench, run_bench

__all__ = ["BenchPlan", "add_bench_parser", "cmd_bench", "format_report", "plan_from_args", "run_bench", "write_json"]
