"""The one channel to a launched job's rendezvous store: the heartbeats, the batch manifest lines and the service's
jobs all reach it through :func:`connect`.

The store is the TCPStore that `env://` already uses (hosted by torchrun's agent, or by rank 0 under srun, mpirun
and hand-started ranks); each channel is its own client connection to it, so a thread can own one.

- **One naming rule**: every key is ``distvideo/<namespace>/<name>``. A namespace names the feature and the run
  (``heartbeat/<n>``, ``batch/<digest>``, ``serve/<session>``), so a later run on a store that outlived its
  predecessor never reads the predecessor's keys.
- **One timeout policy**: connecting and every call wait at most :data:`CALL_TIMEOUT` (a live store answers in
  milliseconds; a gone one is noticed within it, and a thread blocked in a call can be joined within it). Waiting
  for a key that another rank sets later takes its own timeout (:meth:`StoreChannel.wait`).
- **Text only**: values are strings (JSON where structured) and are never unpickled.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from distvideo.launch import LaunchEnv

CALL_TIMEOUT = timedelta(seconds=5)
PREFIX = "distvideo/"


class StoreChannel:
    """One client connection to the rendezvous store, confined to the keys of one namespace."""

    def __init__(self, store: dist.Store, namespace: str):
        if not namespace or namespace.startswith("/") or namespace.endswith("/"):
            raise ValueError(f"a store namespace is a non-empty relative name, got {namespace!r}")
        self.namespace = namespace
        self.prefix = f"{PREFIX}{namespace}/"
        self._store = store

    def key(self, name: str) -> str:
        """The store key of `name` in this namespace."""
        return self.prefix + name

    def set(self, name: str, value: str) -> None:
        self._store.set(self.key(name), value)

    def get(self, name: str) -> str:
        """The value of `name` (waiting up to CALL_TIMEOUT for it to be set)."""
        return self._store.get(self.key(name)).decode(errors="replace")

    def has(self, *names: str) -> bool:
        """Whether every one of `names` is set, without waiting."""
        return bool(self._store.check([self.key(n) for n in names]))

    def wait(self, names: Sequence[str], timeout: timedelta) -> None:
        """Until every one of `names` is set; `dist.DistStoreError` after `timeout`, another `dist.DistError` when
        the store is unreachable."""
        self._store.wait([self.key(n) for n in names], timeout)

    def delete(self, name: str) -> None:
        self._store.delete_key(self.key(name))

    def close(self) -> None:
        """Drop the connection now (a client left to the garbage collector keeps the store's host busy)."""
        self._store = None  # type: ignore[assignment]


def connect(env: LaunchEnv, namespace: str) -> StoreChannel:
    """A new connection to the job's rendezvous store (`env.master_addr:env.master_port`) for `namespace`."""
    return connect_to(StoreAddress(env.master_addr, env.master_port), namespace)


@dataclass(frozen=True)
class StoreAddress:
    """Where a store is: a launched job's TCPStore (`host`, `port`), or a private file store (`file`)."""

    host: str = ""
    port: int = 0
    file: str | None = None


def connect_to(address: StoreAddress, namespace: str) -> StoreChannel:
    """A new connection to the store at `address` (a launched job's, or one :class:`PrivateStore` made)."""
    store: dist.Store
    if address.file is not None:
        store = dist.FileStore(address.file, -1)
        store.set_timeout(CALL_TIMEOUT)
    else:
        store = dist.TCPStore(address.host, address.port, is_master=False, timeout=CALL_TIMEOUT, wait_for_workers=False)
    return StoreChannel(store, namespace)


class PrivateStore:
    """A store for processes of this machine that no launcher gave one (the mp executor's workers): a file store in a
    directory only this user can open (mkdtemp makes it 0700), as the mp executor's own rendezvous is, so nothing
    listens on a port and another user of the machine can neither read nor write it. `close()` removes it."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="distvideo-store-")
        self.address = StoreAddress(file=os.path.join(self._dir, "store"))

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
