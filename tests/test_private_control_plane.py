"""The control plane is private (issue 14): spawned ranks listen on loopback only and meet through a file store in a
0700 directory; launched ranks exchange JSON, never pickles."""

from __future__ import annotations

import ast
import os
import stat
import tempfile
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from distvideo import VideoGenerator
from distvideo.executors.base import RankStatus
from distvideo.executors.external import _all_gather_statuses, all_gather_json

SRC = Path(__file__).resolve().parent.parent / "src" / "distvideo"


def worker_facts(worker):
    rendezvous = worker.rank_info.init_method
    return {"pid": os.getpid(), "rendezvous": rendezvous}


def listening(pid: int) -> list[str]:
    proc = psutil.Process(pid)
    connections = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections("inet")
    return [c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN]


def test_spawned_ranks_listen_on_loopback_only_and_meet_in_a_private_folder():
    with VideoGenerator.from_pretrained(executor="mp", num_gpus=2) as gen:
        facts = gen.collective_rpc(worker_facts)
        addresses = [ip for f in facts for ip in listening(f["pid"])]
        assert addresses and set(addresses) <= {"127.0.0.1", "::1"}, addresses
        rendezvous = facts[0]["rendezvous"]
        assert rendezvous.startswith("file://"), rendezvous
        folder = Path(rendezvous.removeprefix("file://")).parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    assert not folder.exists(), "the rendezvous folder outlived the executor"


@pytest.fixture
def one_rank_group():
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(
            "gloo", init_method=f"file://{folder}/store", rank=0, world_size=1, timeout=timedelta(seconds=30)
        )
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_statuses_travel_as_json(one_rank_group):
    value = {"a": [1, 2.5, None, "é"], "b": {"nested": True}}
    assert all_gather_json(value, one_rank_group, 1) == [value]
    ok = RankStatus(rank=0, ok=True, result={"frames": 3})
    assert _all_gather_statuses(ok, one_rank_group, 1) == [ok]
    # a result that is not JSON becomes this rank's failure, reported on every rank (no pickle fallback)
    [gathered] = _all_gather_statuses(RankStatus(rank=0, ok=True, result=object()), one_rank_group, 1)
    assert not gathered.ok and gathered.error_type == "TypeError" and "travel as JSON" in gathered.error_message


def test_launched_ranks_never_unpickle_what_a_peer_sent():
    forbidden = {"pickle", "cloudpickle", "all_gather_object", "broadcast_object_list", "gather_object", "recv_object"}
    for name in ("executors/external.py", "executors/heartbeat.py"):
        names = set()
        for node in ast.walk(ast.parse((SRC / name).read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.update([(node.module or "").split(".")[0], *(a.name for a in node.names)])
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
        assert names & forbidden == set(), f"{name} uses {sorted(names & forbidden)}"
