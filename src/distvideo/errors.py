"""Every error distvideo raises on purpose, in one module at the bottom of the layers (``from distvideo import ...``).

Bad input is a :class:`ConfigError` (the CLI exits with code 2, nothing is written); everything else is a
``RuntimeError`` subclass (exit code 1).
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Bad input or configuration: the CLI exits with code 2 and nothing is written.

    `param`: the option it is about, by its field name (`num_inference_steps`), when it is about one; the message
    itself names the option as the user gave it (config.Naming), and an edge that answers in names of its own (the
    HTTP service's `param`) maps the field."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class LoraError(ConfigError):
    """A LoRA file that cannot be used with this model (missing, unreadable, for another model), or a LoRA call
    with bad arguments. A user mistake: the CLI exits with code 2."""


class DivergentCallError(ConfigError):
    """Ranks were given different arguments for the same call (a divergent SPMD script)."""


class LaunchEnvError(RuntimeError):
    """The environment does not say where this process sits in a distributed job."""


class ModelLoadError(RuntimeError):
    """A component of a checkpoint could not be loaded (missing or corrupt weights, bad tokenizer)."""


class RankFailure(RuntimeError):
    """One collective call failed on one or more ranks; `failures` maps rank -> (type, message)."""

    def __init__(self, message: str, failures: dict[int, tuple[str, str]]):
        super().__init__(message)
        self.failures = failures


class WorkerDiedError(RuntimeError):
    """A worker process ended during a call (killed, crashed, out of memory); every worker is torn down."""


class CollectiveError(RuntimeError):
    """A collective operation failed in its transport (a peer died or left, or did not arrive in time): raised by the
    code that issued it, whatever error type torch's backend used (gloo raises plain RuntimeErrors)."""


class GenerationCancelled(RuntimeError):
    """The request was stopped at a step boundary on every rank because the caller cancelled it; the executor stays
    usable."""


class GenerationTimeout(GenerationCancelled, TimeoutError):
    """The request ran past its request_timeout and was stopped at a step boundary on every rank; the executor stays
    usable."""


class VideoWriteError(RuntimeError):
    """Writing the video failed after the frames were generated; `frames_path` (an .npy file beside the target) or
    `frames` (when even that failed) keeps them."""

    def __init__(self, message: str, frames_path: Any = None, frames: Any = None):
        super().__init__(message)
        self.frames_path = frames_path
        self.frames = frames


class ProcessGroupBrokenError(RuntimeError):
    """A collective failed (a rank died, did not arrive within dist_timeout, or left the group after a failure of its
    own): no collective can succeed on this process group again. The job must be restarted."""


__all__ = [
    "CollectiveError",
    "ConfigError",
    "DivergentCallError",
    "GenerationCancelled",
    "GenerationTimeout",
    "LaunchEnvError",
    "LoraError",
    "ModelLoadError",
    "ProcessGroupBrokenError",
    "RankFailure",
    "VideoWriteError",
    "WorkerDiedError",
]
