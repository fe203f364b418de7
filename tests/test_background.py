"""tests/background.py, the suite's background jobs: the programs the worker thread starts run at nice 19; a job whose
test comes first runs in the test itself, at the test's nice value; an exception reaches the test."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from background import BackgroundJob, paused, run_program

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


def test_no_job_begins_while_paused():
    job = BackgroundJob("after the pause", _nice)
    with paused():
        job.start()
        time.sleep(0.5)  # the worker would have begun it by now (a job of its own, nothing else queued before it in
        # this file's order), but may not while paused
        assert job._state == "queued"
    job.result()
