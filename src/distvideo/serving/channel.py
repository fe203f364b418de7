"""How the ranks of a launched job (torchrun, srun, mpirun) learn each admitted job from rank 0, which alone runs the
HTTP server: numbered JSON messages in the rendezvous store (a TCPStore), never pickles.

Why the store and not a collective: a broadcast that waits for the next job would wait as long as the service is
idle, hours, and every collective gives up after dist_timeout (600 s by default). A store `wait` for one key has its
own timeout, costs nothing while it waits (the store answers when the key is set) and needs no polling; a rank
whose store connection drops learns at once that the host of the store (rank 0, or torchrun's agent) is gone.
Messages: `msg/<n>` = {"kind": "job", "id", "request": {ResolvedRequest fields}, "lora": [name, strength] | null}
or {"kind": "stop", "reason"}; `stop-request` = {"rank", "reason"} from any rank that received SIGTERM. Every key
sits under `distvideo/serve/<session>/`, a token rank 0 drew at start-up and every rank learned through one
`collective_rpc`, so a restarted job never reads its predecessor's messages from a store that outlived it.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from distvideo.errors import ProcessGroupBrokenError
from distvideo.executors.store import connect
from distvideo.launch import LaunchEnv

if TYPE_CHECKING:
    from distvideo.protocols import GeneratorHandle

logger = logging.getLogger(__name__)

WAIT = timedelta(hours=6)  # one store wait; an idle follower simply waits again


def _session_token(worker: Any, token: str) -> str:
    """Run on every rank by collective_rpc: each returns its own token; rank 0's is the session."""
    return token


class JobChannel:
    """Rank 0 publishes; every other rank receives the same messages in the same order."""

    def __init__(self, env: LaunchEnv, session: str):
        self.env = env
        self.namespace = f"serve/{session}"
        self._store = connect(env, self.namespace)
        self._sent = 0
        self._received = 0
        self._watcher: threading.Thread | None = None

    @classmethod
    def open(cls, gen: GeneratorHandle, env: LaunchEnv) -> JobChannel:
        """Called by every rank at the same point (right after the model loaded)."""
        tokens = gen.collective_rpc(_session_token, args=(secrets.token_hex(8),))
        return cls(env, str(tokens[0]))

    # -- rank 0 ----------------------------------------------------------------------------------
    def publish(self, message: dict[str, Any]) -> None:
        self._sent += 1
        self._store.set(f"msg/{self._sent}", json.dumps(message))
        if self._sent > 2:
            # every rank read message n-2: it ran job n-2's collectives with rank 0 before rank 0 got here
            self._store.delete(f"msg/{self._sent - 2}")

    def stop_everyone(self, reason: str, timeout_s: float = 30.0) -> list[int]:
        """Publish the stop and wait (at most `timeout_s`) until every rank read it: under srun and mpirun rank 0 hosts
        the store, and a rank still waiting on it when rank 0 exits would take that for rank 0's death. Returns the
        ranks that did not answer."""
        self.publish({"kind": "stop", "reason": reason})
        missing = [r for r in range(1, self.env.world_size)]
        try:
            self._store.wait([f"stopped/{r}" for r in missing], timedelta(seconds=timeout_s))
            return []
        except dist.DistError:
            return [r for r in missing if not self._store.has(f"stopped/{r}")]

    def acknowledge_stop(self) -> None:
        self._store.set(f"stopped/{self.env.rank}", "1")

    def watch_stop_requests(self, on_request: Callable[[str], None]) -> None:
        """A thread that waits for any rank's stop request and passes its reason on (once)."""

        def run() -> None:
            store = connect(self.env, self.namespace)
            key = "stop-request"
            while True:
                try:
                    store.wait([key], WAIT)
                except dist.DistStoreError:
                    continue  # nothing in WAIT: wait again
                except Exception:
                    return  # the store is gone: the job is ending
                request = json.loads(store.get(key))
                if request.get("rank") != self.env.rank:
                    on_request(f"rank {request.get('rank')} received {request.get('reason')}")
                return

        self._watcher = threading.Thread(target=run, name="distvideo-serve-stop-watch", daemon=True)
        self._watcher.start()

    # -- any rank --------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """Ask rank 0 to shut the service down (on this rank's own connection: safe from any thread)."""
        try:
            stop = json.dumps({"rank": self.env.rank, "reason": reason})
            connect(self.env, self.namespace).set("stop-request", stop)
        except Exception as exc:
            logger.warning("could not pass the stop request to rank 0 (%s)", exc)

    # -- ranks other than 0 ------------------------------------------------------------------------
    def receive(self) -> dict[str, Any]:
        """The next message, waiting for it as long as it takes; ProcessGroupBrokenError if the store is gone."""
        key = f"msg/{self._received + 1}"
        while True:
            try:
                self._store.wait([key], WAIT)
                raw = self._store.get(key)
                break
            except dist.DistStoreError:
                continue  # nothing in WAIT: wait again
            except dist.DistError as exc:
                where = f"{self.env.master_addr}:{self.env.master_port}"
                raise ProcessGroupBrokenError(
                    f"rank {self.env.rank}: the rendezvous store at {where} is unreachable while waiting for the next "
                    f"job from rank 0 ({str(exc).splitlines()[0]}): rank 0 (or the launcher's agent) is gone; restart "
                    "the job"
                ) from exc
        self._received += 1
        message: dict[str, Any] = json.loads(raw)
        return message
