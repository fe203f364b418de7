"""tests/background.py, the suite's background jobs: the programs the worker thread starts run at nice 19; a job whose
test comes first runs in the test itself, at the test's nice value; an exception reaches the test."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from background import BackgroundJob, FolderJob, run_program
from conftest import _uses_job

NICE = [sys.executable, "-c", "import os; print(os.nice(0))"]


def _nice(stopping: threading.Event, environ: dict[str, str]) -> tuple[str, subprocess.CompletedProcess[str]]:
    return threading.current_thread().name, run_program(NICE, stopping, 60, env=environ)


def test_programs_started_in_the_worker_thread_run_at_nice_19():
    """What the queue's thread starts is niced (the worker itself is exercised by every job of the suite)."""
    seen: list[tuple[str, subprocess.CompletedProcess[str]]] = []
    worker = threading.Thread(target=lambda: seen.append(_nice(threading.Event(), {})), name="background-jobs")
    worker.start()
    worker.join(60)
    assert seen and seen[0][1].stdout.strip() == "19", seen


def test_a_job_not_begun_runs_in_the_test_and_its_exception_reaches_it():
    def fails(stopping: threading.Event, environ: dict[str, str]) -> None:
        raise ValueError(f"planted in {threading.current_thread().name}")

    job = BackgroundJob("fails", fails)
    with pytest.raises(ValueError, match="planted in MainThread"):
        job.result()
    thread, proc = BackgroundJob("nice here", _nice).result()
    assert thread == "MainThread" and proc.stdout.strip() == "0", proc


def test_a_job_stopped_before_it_began_says_so():
    job = BackgroundJob("never", _nice)
    job.stop()  # at the session's end, a job whose test never came
    with pytest.raises(RuntimeError, match="'never' was stopped before it began"):
        job.result()


def _in_a_fresh_process(code: str) -> str:
    """`code`'s standard output, run by a new interpreter with the tests folder on its path: background.py with a
    queue of its own, holding only the jobs `code` starts."""
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": tests}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tests, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


PAUSED = """
import threading, time
import background

job = background.BackgroundJob("after the pause", lambda stopping, environ: threading.current_thread().name)
with background.paused():
    job.start()
    time.sleep(0.5)  # the worker would have begun it by now (nothing queued before it), but may not while paused
    print(job._state)
deadline = time.monotonic() + 30
while job._state == "queued" and time.monotonic() < deadline:  # the worker begins it once the pause ends
    time.sleep(0.01)
print(job.result(), job._state)
"""


def test_no_job_begins_while_paused():
    """In a process of its own (here the pause first waits for the suite's running jobs: 13 s in one run). Once the
    pause ends the worker thread runs the job."""
    assert _in_a_fresh_process(PAUSED).split() == ["queued", "background-jobs", "done"]


WAITED_FOR = """
import threading, time
import background

began = threading.Event()
first = background.BackgroundJob("first", lambda stopping, environ: began.wait(20))
second = background.BackgroundJob("second", lambda stopping, environ: began.set() or threading.current_thread().name)
first.start()
second.start()
while first._state != "running":  # under way in the worker thread, the second queued behind it
    time.sleep(0.01)
print(first.result(), second.result())
"""


def test_while_a_test_waits_for_a_job_under_way_the_next_one_begins():
    """A helper thread runs the queue's next job meanwhile (the first job returns whether the second began before
    it ended: False after 20 s without the helper). In a process of its own, whose queue holds only these two."""
    assert _in_a_fresh_process(WAITED_FOR).split() == ["True", "background-jobs"]


def test_a_folder_job_works_in_a_folder_of_its_own_removed_when_stopped():
    job = FolderJob("in a folder", "folder-job", lambda folder, environ: (folder / "made").write_text("yes"))
    folder, written = job.result()
    assert written == 3 and (folder / "made").read_text() == "yes" and folder.name.startswith("distvideo-folder-job-")
    job.stop()
    assert not folder.exists()


@pytest.mark.parametrize("part", ["alpha-beta"])
def test_a_job_named_with_an_id_starts_only_for_that_parameter(request, part):
    assert _uses_job(request.node, "request") and _uses_job(request.node, "request[beta]")
    assert not _uses_job(request.node, "request[gamma]") and not _uses_job(request.node, "request[alpha-beta]")
    assert not _uses_job(request.node, "tmp_path[beta]"), "a fixture the test does not use"


def test_every_mark_decorates_a_test():
    """A mark on a helper marks nothing: test_mesh.py's launched tests, their marks on the helper above them, ran in
    `make test-fast` (no launchers) for a while."""
    misplaced = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("test"):
                marks = [ast.unparse(d) for d in node.decorator_list if ast.unparse(d).startswith("pytest.mark.")]
                misplaced += [f"{path.name}:{node.lineno} {node.name}: {mark}" for mark in marks]
    assert misplaced == []
