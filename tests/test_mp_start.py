"""How the mp executor starts its workers (executors/mp_start.py): forked from the fork server, which imported the
libraries once, and still given what a spawned worker would have had from the driver at that moment: the driver's
environment, working directory and standard output and error as they are *now*, not as they were when the fork server
started (with an earlier executor)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import cloudpickle
import psutil
import pytest

from distvideo import VideoGenerator
from distvideo.models.embedded import tiny_model_path

pytestmark = pytest.mark.slow

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def state_of(worker):
    """What the worker took from its driver: a variable set after the fork server started, the working directory,
    its parent, and which modules it had before it was given any work."""
    parent = psutil.Process(os.getpid()).parent()
    return {
        "mark": os.environ.get("DISTVIDEO_TEST_MARK"),
        "threads": __import__("torch").get_num_threads(),
        "umask": os.umask(0o022),
        "cwd": os.getcwd(),
        "parent": parent.pid,
        "parent_cmdline": " ".join(parent.cmdline()),
        "cmdline": " ".join(psutil.Process(os.getpid()).cmdline()),
    }


def write_line(worker, text):
    """One whole line per write (the ranks share the file and its offset; a print may write its newline apart)."""
    os.write(1, f"{text} from rank {worker.rank}\n".encode())
    os.write(2, f"{text} on stderr from rank {worker.rank}\n".encode())


def test_forked_workers_take_the_drivers_state_of_the_moment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model = str(tiny_model_path())
    with VideoGenerator.from_pretrained(model, num_gpus=2, executor="mp") as first:  # the fork server runs now
        assert [s["mark"] for s in first.collective_rpc(state_of)] == [None, None]

    monkeypatch.setenv("DISTVIDEO_TEST_MARK", "set after the fork server started")
    monkeypatch.delenv("DISTVIDEO_NUM_THREADS", raising=False)  # (conftest.py's) it would win over OMP_NUM_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's thread count, which the fork server did not read
    monkeypatch.chdir(tmp_path)
    old_umask = os.umask(0o027)  # a umask other than the fork server's
    saved = [os.dup(1), os.dup(2)]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    try:
        for fd, path in ((1, out), (2, err)):  # redirect this process's descriptors, as a shell or pytest would
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        with VideoGenerator.from_pretrained(model, num_gpus=2, executor="mp") as second:
            states = second.collective_rpc(state_of)
            second.collective_rpc(write_line, ("hello",))
    finally:
        os.umask(old_umask)
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)

    assert [s["mark"] for s in states] == ["set after the fork server started"] * 2
    assert [s["cwd"] for s in states] == [str(tmp_path)] * 2
    assert [s["threads"] for s in states] == [3, 3]
    assert [s["umask"] for s in states] == [0o027, 0o027]
    # forked from the fork server (a child of this process), not spawned by this process
    assert {s["parent"] for s in states} != {os.getpid()}
    assert all("multiprocessing.forkserver" in s["parent_cmdline"] for s in states), states
    assert all(psutil.Process(s["parent"]).ppid() == os.getpid() for s in states)
    assert {line for line in out.read_text().splitlines() if line.startswith("hello")} == {
        "hello from rank 0",
        "hello from rank 1",
    }
    assert {line for line in err.read_text().splitlines() if line.startswith("hello")} == {
        "hello on stderr from rank 0",
        "hello on stderr from rank 1",
    }


def test_spawn_start_method_still_spawns(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DISTVIDEO_MP_START", "spawn")
    with VideoGenerator.from_pretrained(str(tiny_model_path()), num_gpus=2, executor="mp") as gen:
        states = gen.collective_rpc(state_of)
    assert {s["parent"] for s in states} == {os.getpid()}
    assert all("spawn_main" in s["cmdline"] for s in states), states
