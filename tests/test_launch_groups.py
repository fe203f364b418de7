"""tests/launch_groups.py: several modules' scripts in one torchrun launch, each seeing what a launch of its own would
have given it (its exit status, its output and errors), in the same rank processes; a script past its timeout ends the
launch with every thread's stack in its errors; a case asked for after its group's launch began gets a launch of its
own."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_groups import LaunchGroup

pytestmark = pytest.mark.launcher

SCRIPT = """
import os, sys, pathlib
rank = int(os.environ["RANK"])
out, kind = pathlib.Path(sys.argv[1]), sys.argv[2]
(out / f"pid{rank}").write_text(str(os.getpid()))
print(f"{kind} on rank {rank}")
if kind == "exits" and rank == 1:
    sys.exit(3)
if kind == "raises":
    raise ValueError(f"planted on rank {rank}")
if kind == "hangs":
    import time
    time.sleep(600)
"""


def _script(kind: str):
    def prepare(folder: Path, environ: dict[str, str]) -> list:
        if kind == "unprepared":
            raise RuntimeError("the case could not be prepared")
        (folder / "script.py").write_text(SCRIPT)
        return [folder / "script.py", folder, kind]

    return prepare


def _pids(folder: Path) -> list[int]:
    return [int((folder / f"pid{rank}").read_text()) for rank in (0, 1)]


def test_cases_run_in_turn_in_one_launch_each_with_its_own_outcome():
    group = LaunchGroup(2)
    kinds = ("writes", "exits", "raises", "unprepared", "hangs")  # a case past its timeout ends the launch: the last
    cases = {kind: group.case(kind, _script(kind), timeout=3 if kind == "hangs" else 60) for kind in kinds}
    late = group.case("late", _script("late"), timeout=60)
    try:
        for case in cases.values():
            case.start()
        folder, proc = cases["writes"].result()
        assert proc.returncode == 0, proc.stderr
        assert "writes on rank 0" in proc.stdout and "writes on rank 1" in proc.stdout, proc.stdout
        assert "exits on rank" not in proc.stdout, "another case's output"
        same = _pids(folder)
        assert same[0] != same[1]

        folder, proc = cases["exits"].result()
        assert proc.returncode == 3 and "exits on rank 1" in proc.stdout, (proc.returncode, proc.stdout)
        assert _pids(folder) == same, "not the same rank processes"

        folder, proc = cases["raises"].result()
        assert proc.returncode == 1 and "ValueError: planted on rank 1" in proc.stderr, proc.stderr
        assert _pids(folder) == same

        with pytest.raises(RuntimeError, match="could not be prepared"):
            cases["unprepared"].result()

        _, proc = cases["hangs"].result()  # every thread's stack in its errors, and the launch ended
        assert proc.returncode != 0 and "Timeout (0:00:03)!" in proc.stderr and "in <module>" in proc.stderr

        folder, proc = late.result()  # not wanted when the launch began: a launch of its own
        assert proc.returncode == 0 and "late on rank 1" in proc.stdout, proc.stderr
        assert len(group.own_launches) == 1 and folder.parent != cases["writes"].result()[0].parent
    finally:
        late.stop()
