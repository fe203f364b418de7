"""The mp executor's wire between the driver and its workers: message framing, and frames in shared memory.

Driver -> worker: a header (call id, op) followed by the payload. Worker -> driver: a pickled (call id, RankStatus).
Both ends are processes of this user on this machine, connected by private pipes (see docs/reliability.md for the
trust model). The output rank hands frames back through a shared-memory segment, never as a pickled copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import signal
import struct
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np

from distvideo.executors.base import RankStatus

if TYPE_CHECKING:
    from distvideo.outputs import ItemOutcome, WorkerOutput

# Wire format. Driver -> worker: a header (call id, op) followed by the payload. Worker -> driver: a
# pickled (call id, RankStatus). Call id 0 is the start-up report.
HEADER = struct.Struct("<qB")
OP_CALL = 1  # payload: pickled (method, args, kwargs)
OP_FORWARD = 2  # payload: pickled GenerationRequest; the output rank answers with frames in shared memory
OP_SHUTDOWN = 3
OP_BATCH = 4  # payload: pickled shares; the replicas' output ranks send an ItemNote after every item
IN_SHM = 0x80  # flag: the payload is a pickled (segment name, size) of a shared-memory segment
INLINE_PAYLOAD_MAX = 64 * 1024  # below the pipe's buffer, so a busy worker never blocks the driver
STARTUP_ID = 0


class RemoteTraceback(Exception):
    """The tracebacks of failed ranks, chained as the cause of the error raised in the driver."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class ProgressNote:
    """Sent by the output rank after every denoising step of a request, before its answer."""

    done: int
    total: int


@dataclass(frozen=True)
class ItemNote:
    """Sent by a replica's output rank after every batch item: the item's outcome, its frames in shared memory."""

    outcome: ItemOutcome  # without frames
    frames: SharedFrames | None


#: The control block: a shared-memory word the driver writes and every worker reads between denoising steps: the id
#: of the call to cancel (the workers decide together, with one all-reduce per step, so they stop at the same step).
CONTROL = struct.Struct("<q")


class ControlBlock:
    """The driver's side creates it; a worker opens it by name."""

    def __init__(self, name: str | None = None):
        self.segment = SharedMemory(name=name, create=name is None, size=CONTROL.size)
        self.owner = name is None
        if self.owner:
            CONTROL.pack_into(segment_buffer(self.segment), 0, -1)

    @property
    def name(self) -> str:
        return self.segment.name

    def cancel(self, call_id: int) -> None:
        CONTROL.pack_into(segment_buffer(self.segment), 0, call_id)

    def cancelled(self, call_id: int) -> bool:
        return bool(CONTROL.unpack_from(segment_buffer(self.segment), 0)[0] == call_id)

    def close(self) -> None:
        self.segment.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.segment.unlink()


@dataclass(frozen=True)
class SharedFrames:
    """Where the output rank left its frames: a shared-memory segment the driver copies out and unlinks."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def dumps(obj: Any) -> bytes:
    """pickle, or cloudpickle when pickle cannot (lambdas, functions defined in __main__ or a notebook)."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        data: bytes = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # cloudpickle has no annotations
        return data


def describe_exit(exitcode: int | None) -> str:
    """'killed by SIGKILL', 'exit code 3': how a worker process ended, for error messages."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def exit_hint(exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        return " SIGKILL often comes from the kernel's out-of-memory killer (see `dmesg`)."
    if exitcode == -signal.SIGSEGV:
        return " SIGSEGV is a crash in native code (torch, a CUDA driver, an extension)."
    return ""


def segment_buffer(segment: SharedMemory) -> memoryview:
    buf = segment.buf
    if buf is None:
        raise RuntimeError(f"shared-memory segment {segment.name} is closed")
    return buf


def unlink_frames(shared: SharedFrames) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment = SharedMemory(name=shared.name)
        segment.close()
        segment.unlink()


def take_frames(shared: SharedFrames) -> np.ndarray:
    """Copy the output rank's frames out of shared memory into an array the driver owns, then unlink."""
    segment = SharedMemory(name=shared.name)
    try:
        view = np.ndarray(shared.shape, dtype=np.dtype(shared.dtype), buffer=segment_buffer(segment))
        frames = view.copy()
        del view  # the segment cannot close while an array points into it
    finally:
        segment.close()
        segment.unlink()
    return frames


def discard(status: RankStatus) -> None:
    """Release what an answer nobody will read holds (frames in shared memory)."""
    result = status.result
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], SharedFrames):
        unlink_frames(result[1])


def remote_traceback(statuses: Any) -> RemoteTraceback | None:
    parts = [f"rank {s.rank}:\n{s.traceback.rstrip()}" for s in statuses if s.traceback]
    return RemoteTraceback("\n\n".join(parts)) if parts else None


def export_frames(output: WorkerOutput) -> tuple[WorkerOutput, SharedFrames | None]:
    """Move the output rank's frames into a shared-memory segment the driver will copy out and unlink."""
    frames = output.frames
    if frames is None:
        return output, None
    segment = SharedMemory(create=True, size=max(1, frames.nbytes))
    try:
        view = np.ndarray(frames.shape, dtype=frames.dtype, buffer=segment_buffer(segment))
        view[...] = frames
        del view
        shared = SharedFrames(segment.name, tuple(frames.shape), frames.dtype.str)
    finally:
        segment.close()
    return dataclasses.replace(output, frames=None), shared
