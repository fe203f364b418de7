"""Heartbeats of the ranks under an external launcher, and what they tell after a collective failed.

Each rank bumps a counter in the rendezvous store every HEARTBEAT_INTERVAL_S, with what it is doing. When a collective
fails, the survivors read the others': a counter that stopped is a lost rank, one that moves is a busy or stuck rank,
and its text says where (`diagnose`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from distvideo import envs
from distvideo.executors.store import CALL_TIMEOUT, StoreChannel, connect
from distvideo.launch import LaunchEnv

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5  # how often each rank bumps its heartbeat in the rendezvous store
LOST_AFTER_S = 3.0  # after a failed collective: a rank whose heartbeat does not move for this long is lost
STORE_TIMEOUT_S = CALL_TIMEOUT.total_seconds()  # the longest one call on a heartbeat's store connection can block


@dataclass(frozen=True)
class Pulse:
    """One heartbeat: its counter, and what the rank was doing (call number, phase, call name, failure text)."""

    beat: int
    call: int
    phase: str  # "running" (its part of the call), "exchanging" (in a collective), "failed", "idle"
    what: str
    detail: str = ""

    def encode(self) -> str:
        return "|".join([str(self.beat), str(self.call), self.phase, self.what, self.detail.replace("\n", " ")])

    @classmethod
    def decode(cls, raw: str) -> Pulse:
        beat, call, phase, what, detail = raw.split("|", 4)
        return cls(int(beat), int(call), phase, what, detail)

    def describe(self) -> str:
        if self.phase == "failed":
            return f"failed in {self.what} (call {self.call}): {self.detail}"
        verb = {"running": "running", "exchanging": "in the collective of", "idle": "done with"}.get(self.phase, "in")
        return f"{verb} {self.what} (call {self.call})"


class Heartbeat:
    """This rank's heartbeat in the rendezvous store (`distvideo/heartbeat/<n>/<rank>`): a daemon thread bumps a counter
    every HEARTBEAT_INTERVAL_S, with what the rank is doing, on its own connection. After a failed collective the
    survivors read the others': a counter that stopped is a lost rank, one that moves is a busy or stuck rank, and its
    text says where. The store lives in rank 0 (hand-started, srun, mpirun) or in the torchrun agent."""

    instances = 0  # heartbeats started in this process; every rank starts the same ones, so the numbers agree

    def __init__(self, env: LaunchEnv):
        self.rank, self.world_size = env.rank, env.world_size
        Heartbeat.instances += 1
        namespace = f"heartbeat/{Heartbeat.instances}"  # a later generator's keys are its own
        self._publisher: StoreChannel | None = connect(env, namespace)  # the thread's connection
        self._reader: StoreChannel | None = connect(env, namespace)  # the caller's
        self._pulse = Pulse(0, 0, "idle", "start-up")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distvideo-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, env: LaunchEnv) -> Heartbeat | None:
        try:
            return cls(env)
        except Exception:  # no heartbeats: faults are still raised, only without naming the rank
            logger.warning("cannot reach the rendezvous store for heartbeats; a lost rank will not be named")
            logger.debug("heartbeat start-up failed", exc_info=True)
            return None

    @staticmethod
    def key(rank: int) -> str:
        return str(rank)

    def publish(self, pulse: Pulse) -> None:
        """Called by the main thread at each phase of a call: no I/O, so calls cost nothing more; the thread sends the
        latest state with its next beat (the readers wait seconds, never less than a beat)."""
        self._pulse = pulse

    def _run(self) -> None:
        beat = 0
        while not self._stopped.is_set():
            beat += 1
            pulse = dataclasses.replace(self._pulse, beat=beat)
            publisher = self._publisher
            try:
                if publisher is None:
                    return
                publisher.set(self.key(self.rank), pulse.encode())
            except Exception:
                return  # the store went away with its host; the survivors find out when they look
            self._stopped.wait(HEARTBEAT_INTERVAL_S)

    def read(self) -> dict[int, Pulse]:
        """The last pulse of every other rank that sent one; raises when the store is unreachable."""
        out: dict[int, Pulse] = {}
        reader = self._reader
        if reader is None:
            raise RuntimeError("the heartbeat was stopped")
        for r in range(self.world_size):
            if r != self.rank and reader.has(self.key(r)):
                out[r] = Pulse.decode(reader.get(self.key(r)))
        return out

    def survey(self, within: float) -> tuple[dict[int, Pulse], set[int]]:
        """(last pulse of each other rank, the ranks whose heartbeat moved within `within` seconds)."""
        first = self.read()
        latest, alive = dict(first), set()
        deadline = time.monotonic() + within
        while True:
            now = self.read()
            alive |= {r for r, p in now.items() if r not in first or p.beat != first[r].beat}
            latest.update(now)
            if len(alive) >= self.world_size - 1 or time.monotonic() >= deadline:
                return latest, alive
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the thread and close both connections now. A connection left to the garbage collector keeps rank 0's
        store alive, and a later process group on the same port (a new VideoGenerator) would find its stale keys.

        The join waits as long as one store call can block: a thread still inside a call of the store's C++ client
        when the interpreter finalizes is ended by CPython as it takes the GIL back, inside C++, and the process
        aborts ("terminate called without an active exception"). The abort of issue 26 was a gloo thread of the same
        kind, not this one (Worker.shutdown)."""
        self._stopped.set()
        self._thread.join(timeout=STORE_TIMEOUT_S + 2.0)
        if self._thread.is_alive():
            logger.warning("the heartbeat thread did not stop within %.0f s", STORE_TIMEOUT_S + 2.0)
        for channel in (self._publisher, self._reader):
            if channel is not None:
                channel.close()
        self._publisher = self._reader = None


def diagnose(heartbeat: Heartbeat | None, env: LaunchEnv, call: int) -> tuple[str, list[str]]:
    """(headline, one line per abnormal peer) from the peers' heartbeats, seen from rank `env.rank` at call number
    `call`, after a collective failed."""
    others = [r for r in range(env.world_size) if r != env.rank]
    if heartbeat is None:
        return "a peer failed or is stuck", ["  the ranks' heartbeats are unavailable, so which one cannot be told"]
    try:
        pulses, alive = heartbeat.survey(LOST_AFTER_S)
    except Exception as exc:
        where = f"{env.master_addr}:{env.master_port}"
        if envs.is_set("TORCHELASTIC_RUN_ID"):  # torchrun's agent hosts the store, not rank 0
            return "the torchrun agent is gone", [
                f"  the rendezvous store the agent hosts at {where} is unreachable ({first_line(exc)})"
            ]
        return "rank 0 lost", [
            f"  rank 0: lost: the rendezvous store it hosts at {where} is unreachable ({first_line(exc)}): its "
            "process died (killed, out of memory or crashed; see its output and the launcher's report)"
        ]
    lost, failed, stuck, lines = [], [], [], []
    for r in others:
        pulse = pulses.get(r)
        last = f"; its last report: {pulse.describe()}" if pulse is not None else ""
        if r not in alive and pulse is not None and pulse.phase == "failed":
            failed.append(r)
            lines.append(f"  rank {r}: {pulse.describe()}; its heartbeat has stopped since (the process ended)")
        elif r not in alive:
            lost.append(r)
            lines.append(
                f"  rank {r}: lost: no heartbeat for {LOST_AFTER_S:g} s (its process died: killed, out of memory "
                f"or crashed; see its output and the launcher's report){last}"
            )
        elif pulse is not None and pulse.phase == "failed":
            failed.append(r)
            lines.append(f"  rank {r}: alive, but {pulse.describe()}")
        elif pulse is not None and (pulse.call < call or pulse.phase == "running"):
            stuck.append(r)
            lines.append(f"  rank {r}: alive, but did not reach the collective within dist_timeout: {pulse.describe()}")
    if lost:
        return f"{ranks_text(lost)} lost", lines
    if failed:
        return f"{ranks_text(failed)} failed", lines
    if stuck:
        return f"{ranks_text(stuck)} not responding", lines
    return "a collective failed although every rank is alive", lines


def first_line(exc: BaseException | str) -> str:
    """The message without the C++ stack torch appends ("Exception raised from ...")."""
    text = str(exc).split("\nException raised from", 1)[0].strip()
    return text.splitlines()[0] if text else ""


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
