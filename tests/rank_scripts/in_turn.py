"""Run by every rank under torchrun: several tests' rank scripts one after another in this one process
(tests/launch_groups.py), each as ``python SCRIPT ARGS...`` would run it, so that the launch imports torch, diffusers
and transformers once for all of them (about 5 CPU-seconds a rank).

usage: in_turn.py PLAN_JSON

PLAN_JSON: a list of {"name", "argv": [SCRIPT, *ARGS] or ["-m", MODULE, *ARGS], "logs": FOLDER, "timeout": SECONDS}. For each entry in
turn every rank runs SCRIPT (or MODULE) as __main__, with sys.argv and sys.path[0] as ``python`` would set them (the
script's folder; for a module, the working directory); its standard output and error (the
descriptors, so the libraries' own writes too) go to FOLDER/rank<R>.out and .err, and FOLDER/rank<R>.rc gets its exit
status: SystemExit's code, 1 for an exception (its traceback in .err), else 0. A script still running after its
timeout ends the process, every thread's traceback in its .err (faulthandler), and so the launch. A process group the
script left
initialized is destroyed before the next entry, and what it replaced in torch.distributed (run_cases.py counts
all_to_all_single calls through a wrapper of its own) is put back, so every script starts as in a process of its own.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch.distributed as dist


def run(argv: list[str], logs: Path, rank: int, timeout: float) -> int:
    saved_argv, saved_path, saved_dist = sys.argv, sys.path[0], dict(vars(dist))
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with open(logs / f"rank{rank}.out", "w") as out, open(logs / f"rank{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        faulthandler.dump_traceback_later(timeout, exit=True)  # to descriptor 2: this script's .err
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file first, as python -m does
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = str(Path(argv[0]).resolve().parent)
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:  # a message: the interpreter prints it and exits 1
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            faulthandler.cancel_dump_traceback_later()
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            sys.argv, sys.path[0] = saved_argv, saved_path
    if dist.is_initialized():
        dist.destroy_process_group()
    for name, value in saved_dist.items():
        if getattr(dist, name, None) is not value:
            setattr(dist, name, value)
    return code


def main() -> None:
    rank = int(os.environ["RANK"])
    for entry in json.loads(Path(sys.argv[1]).read_text()):
        logs = Path(entry["logs"])
        code = run(entry["argv"], logs, rank, entry["timeout"])
        (logs / f"rank{rank}.rc").write_text(str(code))
        print(f"in_turn: rank {rank}: {entry['name']} exited {code}", flush=True)


if __name__ == "__main__":
    main()
