"""Several modules' torchrun launches as one: the rank scripts of every test module that launches N ranks under
torchrun only to check what the script wrote run one after another in the same N processes
(tests/rank_scripts/in_turn.py), in one background job (background.py).

A launched rank spends about 5 of its 6 CPU-seconds importing torch, diffusers and transformers; on the 2-core CI
machine, whose suite is CPU-bound, every launch folded into another saves N times that. What a test sees is what a
launch of its own gave it: ``(folder, CompletedProcess)``, the script's exit status (the highest of its ranks'), and
its output and errors, rank by rank. Only launches that need nothing of their own qualify: no environment variable
(torch and the libraries read some once, at import), no other launcher, no failure meant to end the process, and no
figure of the whole process (a peak resident memory is the process's high-water mark, which an earlier script sets).

Use, in a test module::

    def _prepare(folder, environ):  # in the background thread: build what the script needs; return its argv
        return [SCRIPT, str(folder)]

    LAUNCH = torchrun_case("stopping under torchrun", 2, _prepare, timeout=300)
    BACKGROUND_JOBS = {"launched": LAUNCH.hooks}
    launched = LAUNCH.fixture("launched")

Every case whose test was collected joins its group's launch (conftest.py starts the hooks while no job may begin,
so a launch never begins before all of its cases are known). A case asked for after its group's launch began without
it (a test run on its own, a fixture asked for mid-test) gets a launch of its own, as before.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from background import FolderJob

IN_TURN = Path(__file__).resolve().parent / "rank_scripts" / "in_turn.py"

Prepare = Callable[[Path, dict[str, str]], Sequence[Any]]
T = TypeVar("T")


def once(make: Callable[[Path, dict[str, str]], T]) -> Callable[[Path, dict[str, str]], T]:
    """What several cases' prepare steps share (a checkpoint the 2- and the 4-rank scripts both load):
    ``make(folder, environ)`` runs for the first caller only, in that caller's folder (removed with it, at the session's
    end); later callers get what it returned. One that raised is tried again by the next caller."""
    lock = threading.Lock()
    made: list[T] = []

    def get(folder: Path, environ: dict[str, str]) -> T:
        with lock:
            if not made:
                made.append(make(folder, environ))
            return made[0]

    return get


class LaunchCase:
    """One module's script in its group's launch; `result()` is (folder, CompletedProcess), as a FolderJob's."""

    def __init__(self, group: LaunchGroup, name: str, prepare: Prepare, timeout: float) -> None:
        self.group, self.name, self.prepare, self.timeout = group, name, prepare, timeout

    def start(self) -> None:
        self.group.want(self)

    def stop(self) -> None:
        self.group.job.stop()
        for job in self.group.own_launches:
            job.stop()

    def result(self) -> tuple[Path, subprocess.CompletedProcess[str]]:
        return self.group.result(self)

    @property
    def hooks(self) -> tuple[Callable[[], None], Callable[[], None]]:
        return self.start, self.stop

    def fixture(self, name: str, scope: str = "function") -> Any:
        import pytest

        def result() -> tuple[Path, subprocess.CompletedProcess[str]]:
            return self.result()

        result.__name__ = name
        return pytest.fixture(scope=scope, name=name)(result)  # type: ignore[call-overload]


class LaunchGroup:
    """The cases of one world size, in one torchrun launch (a FolderJob; each case works in a folder of its own)."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self.cases: dict[str, LaunchCase] = {}
        self._lock = threading.Lock()
        self._wanted: list[LaunchCase] = []
        self._included: list[LaunchCase] | None = None  # fixed when the launch begins
        self.job = FolderJob(f"{nproc} ranks under torchrun, several modules' scripts", f"torchrun{nproc}", self._work)
        self.own_launches: list[FolderJob] = []

    def case(self, name: str, prepare: Prepare, timeout: float) -> LaunchCase:
        if name in self.cases:
            raise ValueError(f"a case named {name!r} is in the {self.nproc}-rank launch already")
        self.cases[name] = LaunchCase(self, name, prepare, timeout)
        return self.cases[name]

    def want(self, case: LaunchCase) -> None:
        with self._lock:
            if self._included is None and case not in self._wanted:
                self._wanted.append(case)
        self.job.start()

    def result(self, case: LaunchCase) -> tuple[Path, subprocess.CompletedProcess[str]]:
        with self._lock:
            if self._included is None and case not in self._wanted:
                self._wanted.append(case)
        _, results = self.job.result()
        if case.name in results:
            outcome = results[case.name]
        else:  # the launch began without it: one of its own
            job = FolderJob(f"{case.name} (a launch of its own)", f"torchrun{self.nproc}", self._own_work(case))
            self.own_launches.append(job)
            _, own = job.result()
            outcome = own[case.name]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _own_work(self, case: LaunchCase) -> Callable[[Path, dict[str, str]], dict[str, Any]]:
        return lambda folder, environ: _launch([case], self.nproc, folder, environ)

    def _work(self, folder: Path, environ: dict[str, str]) -> dict[str, Any]:
        with self._lock:
            self._included = list(self._wanted)
        return _launch(self._included, self.nproc, folder, environ)


def _launch(cases: list[LaunchCase], nproc: int, folder: Path, environ: dict[str, str]) -> dict[str, Any]:
    """Prepare every case (one that fails to prepare keeps its exception), launch the rest in turn, and read back
    each case's outcome."""
    from launchers import run_launcher

    outcomes: dict[str, Any] = {}
    plan = []
    for case in cases:
        own = folder / case.name.replace(" ", "-")
        logs = folder / "in_turn" / own.name
        own.mkdir()
        logs.mkdir(parents=True)
        try:
            argv = [str(a) for a in case.prepare(own, environ)]
        except BaseException as exc:  # handed to the case's test
            outcomes[case.name] = exc
            continue
        plan.append((case, own, logs, argv))
    if not plan:
        return outcomes
    (folder / "plan.json").write_text(
        json.dumps(
            [
                {"name": case.name, "argv": argv, "logs": str(logs), "timeout": case.timeout}
                for case, _, logs, argv in plan
            ]
        )
    )
    launch = run_launcher(
        "torchrun",
        [str(IN_TURN), str(folder / "plan.json")],
        nproc=nproc,
        timeout=sum(case.timeout for case, *_ in plan) + 60,  # a script past its own timeout ends the launch first
        base=environ,
    )
    for case, own, logs, argv in plan:
        codes = [_read(logs / f"rank{r}.rc") for r in range(nproc)]
        if all(code is not None for code in codes):
            returncode = max(int(code) for code in codes)  # type: ignore[arg-type]
            launcher_output = ""
        else:  # a rank never finished the script (it died, or the launch was killed): the launch's own account
            returncode = launch.returncode or -1
            launcher_output = f"--- the launch of {[c.name for c, *_ in plan]} ---\n{launch.stdout}\n{launch.stderr}"
        stdout = "".join(_read(logs / f"rank{r}.out") or "" for r in range(nproc))
        stderr = "".join(_read(logs / f"rank{r}.err") or "" for r in range(nproc)) + launcher_output
        outcomes[case.name] = (own, subprocess.CompletedProcess(["torchrun", *argv], returncode, stdout, stderr))
    return outcomes


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None


_GROUPS: dict[int, LaunchGroup] = {}


def torchrun_case(name: str, nproc: int, prepare: Prepare, timeout: float = 300) -> LaunchCase:
    """A script of `nproc` ranks in the shared torchrun launch of that many ranks: ``prepare(folder, environ)`` runs
    in the background thread, in the case's own folder, and returns the script's argv (the script first, or "-m" and
    a module, as for python)."""
    group = _GROUPS.setdefault(nproc, LaunchGroup(nproc))
    return group.case(name, prepare, timeout)
