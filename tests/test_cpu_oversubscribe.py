"""More CPU ranks than cores (issue 55, defect 8): `--num-gpus 64` on 2 cores started 64 ranks without a word, and
every one of them was still on its way out when the driver's shutdown grace ran out (all 64 SIGTERMed). The driver
now says so once, before any rank starts; and a rank's way out no longer walks, and copies, the heap it inherited from
the fork server (a full collection over about 440,000 imported objects: 0.28 CPU-seconds and 91 MB of copied pages
per rank), so the ranks leave by themselves within the grace."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator

import cloudpickle
import psutil
import pytest

from distvideo import VideoGenerator
from distvideo.executors import mp_procs
from distvideo.models.embedded import tiny_model_path

from processes import wait_gone

# heap_of travels to the workers by value: they need not import this test module
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MP_PROCS = "distvideo.executors.mp_procs"


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[logging.LogRecord]]:
    """The records of logger `name` from WARNING up, by a handler of its own (distvideo's logger may not propagate
    to pytest's)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_more_cpu_ranks_than_cores_is_one_warning_naming_both_and_what_would_work():
    with logged(MP_PROCS) as records:
        mp_procs.warn_if_oversubscribed(2, 2)  # as many ranks as cores: nothing to say
        mp_procs.warn_if_oversubscribed(64, 2)
    assert len(records) == 1, [r.getMessage() for r in records]
    text = records[0].getMessage()
    assert "64 CPU ranks on 2 cores" in text and "about 0.031 of a core" in text, text
    assert "start-up and every step are slow" in text, text
    assert "at most 2 ranks (--num-gpus / num_gpus)" in text and "one GPU per rank" in text, text


def heap_of(worker) -> dict[str, object]:
    """What a full collection costs this rank: the objects it walks, the ones it holds frozen (inherited from the fork
    server), and how much memory it shared with the fork server the collection copied into the rank."""
    process = psutil.Process()
    before = process.memory_full_info().uss
    gc.collect()
    return {
        "walked": len(gc.get_objects()),
        "frozen": gc.get_freeze_count(),
        "copied_mb": (process.memory_full_info().uss - before) / 2**20,
        "cpus": sorted(os.sched_getaffinity(0)),
    }


@pytest.mark.slow
def test_ranks_beyond_the_cores_are_announced_and_leave_by_themselves():
    everywhere = os.sched_getaffinity(0)
    one_core = {min(everywhere)}
    os.sched_setaffinity(0, one_core)  # this thread and what it starts only (Linux): 2 ranks on one core
    try:
        with logged(MP_PROCS) as starting:
            gen = VideoGenerator.from_pretrained(str(tiny_model_path()), num_gpus=2, executor="mp")
    finally:
        os.sched_setaffinity(0, everywhere)
    procs = list(gen.executor._procs)
    try:
        heaps = gen.collective_rpc(heap_of)
    finally:
        with logged(MP_PROCS) as stopping:
            gen.shutdown()

    assert [r.getMessage().split(":")[0] for r in starting] == ["2 CPU ranks on 1 core"]
    assert [h["cpus"] for h in heaps] == [sorted(one_core)] * 2, heaps
    for heap in heaps:  # the full collection a rank runs on its way out (Worker.shutdown) walks its own objects only
        assert heap["walked"] < heap["frozen"], heaps
        assert heap["copied_mb"] < 16, heaps
    assert [r.getMessage() for r in stopping] == [], "the ranks had to be signalled"
    assert [p.exitcode for p in procs] == [0, 0], "left by themselves, within the shutdown grace"
    assert wait_gone([p.pid for p in procs if p.pid is not None], within=5) == []
