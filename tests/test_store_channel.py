"""executors/store.py, the one channel to the rendezvous store (heartbeats, batch manifest lines, the service's
jobs), against a real TCPStore hosted in this process: the naming rule keeps namespaces apart, values are text, a
wait gives up after its own timeout, and a gone host is an error rather than a hang."""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
import torch.distributed as dist

from distvideo.executors.store import StoreChannel, connect
from distvideo.launch import LaunchEnv


@pytest.fixture
def host() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def env_of(store: dist.TCPStore) -> LaunchEnv:
    return LaunchEnv(
        rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=store.port,
        launcher="torchrun",
    )  # fmt: skip


def test_keys_follow_the_naming_rule_and_namespaces_stay_apart(host):
    one, two = connect(env_of(host), "serve/abc"), connect(env_of(host), "batch/def")
    one.set("msg/1", '{"kind": "job"}')
    assert one.key("msg/1") == "distvideo/serve/abc/msg/1"
    assert host.get("distvideo/serve/abc/msg/1") == b'{"kind": "job"}'  # the raw store holds the prefixed key
    assert one.has("msg/1") and one.get("msg/1") == '{"kind": "job"}'
    assert not two.has("msg/1")  # another namespace does not see it
    one.delete("msg/1")
    assert not one.has("msg/1") and not host.check(["distvideo/serve/abc/msg/1"])


def test_a_wait_gives_up_after_its_own_timeout_and_sees_a_key_set_meanwhile(host):
    channel = connect(env_of(host), "heartbeat/1")
    with pytest.raises(dist.DistStoreError):
        channel.wait(["0"], timedelta(milliseconds=200))
    connect(env_of(host), "heartbeat/1").set("0", "beat")  # another rank's connection
    channel.wait(["0"], timedelta(seconds=10))
    assert channel.get("0") == "beat"


def test_a_gone_host_is_an_error_not_a_hang():
    """The host of the store (rank 0, or torchrun's agent) died: a call is an error (within the call timeout, which
    the heartbeat thread's join relies on), not a hang."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    channel = connect(env_of(host), "serve/x")
    channel.set("msg/1", "{}")
    del host
    gc.collect()
    with pytest.raises(dist.DistError):
        for _ in range(3):  # a call already on its way when the host closed may still be answered
            channel.get("msg/1")


@pytest.mark.parametrize("namespace", ["", "/abs", "trailing/"])
def test_a_bad_namespace_is_refused(host, namespace):
    with pytest.raises(ValueError, match="namespace"):
        StoreChannel(host, namespace)
