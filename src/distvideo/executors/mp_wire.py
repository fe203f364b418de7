"""The mp executor's wire between the driver and its workers: message framing, and arrays in shared memory.

Driver -> worker: a header (call id, op) followed by the payload, a pickled `WireCall`. Worker -> driver: a pickled
(call id, RankStatus) answer, or (call id, Note) for an event during the call. Both ends are processes of this user on
this machine, connected by private pipes (see docs/reliability.md for the trust model). Every numpy array and CPU
tensor inside an answer or an event (a forward's frames, a batch item's) travels through a shared-memory segment of
its own, never as a pickled copy: `dumps_shared` moves it out, `loads_shared` copies it into memory the driver owns
and unlinks the segment.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import signal
import struct
import sys
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import cloudpickle
import numpy as np

# Wire format. Driver -> worker: a header (call id, op) followed by the payload. Worker -> driver: a
# pickled (call id, RankStatus or Note). Call id 0 is the start-up report.
HEADER = struct.Struct("<qB")
OP_CALL = 1  # payload: a pickled WireCall
OP_SHUTDOWN = 3
IN_SHM = 0x80  # flag: the payload is a pickled (segment name, size) of a shared-memory segment
INLINE_PAYLOAD_MAX = 64 * 1024  # below the pipe's buffer, so a busy worker never blocks the driver
STARTUP_ID = 0
#: The longest one wait of the driver blocks. A Ctrl-C that the kernel delivers to another thread of the driver
#: (torch's OpenMP threads, for one) does not interrupt the main thread's poll; waking at least this often lets the
#: main thread run the pending handler and raise KeyboardInterrupt.
WAIT_SLICE_S = 0.5


@dataclass(frozen=True)
class WireCall:
    """One call as every worker receives it: the method and its arguments, and which call options it carries."""

    method: Any  # a worker method's name or a callable (pickled by value)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    events: bool = False  # the worker method gets `emit`
    stoppable: bool = False  # the worker method gets `cancelled`, reading the control block
    unique_reply_rank: int | None = None  # only this rank emits and sends its result


@dataclass(frozen=True)
class Note:
    """An event a rank emitted during call (call id), delivered to the call's `on_event` in the driver."""

    value: Any


class RemoteTraceback(Exception):
    """The tracebacks of failed ranks, chained as the cause of the error raised in the driver."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


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


def remote_traceback(statuses: Any) -> RemoteTraceback | None:
    parts = [f"rank {s.rank}:\n{s.traceback.rstrip()}" for s in statuses if s.traceback]
    return RemoteTraceback("\n\n".join(parts)) if parts else None


# --- arrays through shared memory --------------------------------------------------------------
def _export(data: np.ndarray) -> str:
    """Copy `data` into a new shared-memory segment (left for the reader to unlink); its name."""
    segment = SharedMemory(create=True, size=max(1, data.nbytes))
    try:
        view = np.ndarray(data.shape, dtype=data.dtype, buffer=segment_buffer(segment))
        view[...] = data
        del view  # the segment cannot close while an array points into it
    finally:
        segment.close()
    return segment.name


def _take(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Copy an array out of shared memory into memory this process owns, then unlink the segment."""
    segment = SharedMemory(name=name)
    try:
        view = np.ndarray(shape, dtype=np.dtype(dtype), buffer=segment_buffer(segment))
        data = view.copy()
        del view
    finally:
        segment.close()
        segment.unlink()
    return data


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment = SharedMemory(name=name)
        segment.close()
        segment.unlink()


class _Exporting:
    """The pickler side: every array and CPU tensor becomes a reference to its shared-memory segment."""

    segments: list[str]

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            name = _export(obj)
            self.segments.append(name)
            return ("ndarray", name, obj.shape, obj.dtype.str)
        torch = sys.modules.get("torch")  # a process that has no tensors need not import torch
        if (
            torch is not None
            and isinstance(obj, torch.Tensor)
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not (obj.requires_grad or obj.is_quantized)
        ):
            raw = obj.contiguous().reshape(-1).view(torch.uint8).numpy()  # any dtype, as bytes
            name = _export(raw)
            self.segments.append(name)
            return ("tensor", name, tuple(obj.shape), str(obj.dtype).removeprefix("torch."), raw.shape)
        return None


class _SharedPickler(_Exporting, pickle.Pickler):
    pass


class _SharedCloudPickler(_Exporting, cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle has no annotations
    pass


class _SharedUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "ndarray":
            _, name, shape, dtype = pid
            return _take(name, shape, dtype)
        _, name, shape, dtype, raw_shape = pid
        import torch

        raw = torch.from_numpy(_take(name, raw_shape, "|u1"))
        return raw.view(getattr(torch, dtype)).reshape(shape)


def dumps_shared(obj: Any) -> bytes:
    """`dumps` for answers and events: arrays and CPU tensors go to shared memory (segments of an attempt that
    failed are unlinked before the next one)."""
    for pickler_class in (_SharedPickler, _SharedCloudPickler):
        buffer = io.BytesIO()
        pickler = pickler_class(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.segments = []
        try:
            pickler.dump(obj)
            return buffer.getvalue()
        except (pickle.PicklingError, AttributeError, TypeError):
            for name in pickler.segments:
                _unlink(name)
            if pickler_class is _SharedCloudPickler:
                raise
    raise AssertionError("unreachable")


def loads_shared(data: bytes) -> Any:
    """The inverse of `dumps_shared`: every array comes back in this process's own memory, its segment unlinked."""
    return _SharedUnpickler(io.BytesIO(data)).load()
