"""distvideo: run video diffusion transformers on one or many devices, under torchrun, srun, mpirun
or its own worker processes."""

import importlib
from typing import TYPE_CHECKING, Any

from distvideo import envs

envs.reproducible_cpu_math()  # before anything computes: MKL reads its mode once (envs.MKL_REPRODUCIBLE)

from distvideo import families  # noqa: E402, F401  (the families register themselves: models/family.py)
from distvideo.config import EngineConfig  # noqa: E402 (after the MKL mode)
from distvideo.errors import (  # noqa: E402
    ConfigError,
    DivergentCallError,
    GenerationCancelled,
    GenerationTimeout,
    LaunchEnvError,
    LoraError,
    ModelLoadError,
    ProcessGroupBrokenError,
    RankFailure,
    VideoWriteError,
    WorkerDiedError,
)
from distvideo.request import GenerationRequest, ResolvedRequest  # noqa: E402

if TYPE_CHECKING:
    from distvideo.generator import VideoGenerator
    from distvideo.outputs import GenerationResult

#: imported at first use, so that `import distvideo` (the CLI's bad-input exits, --help) does not import torch
_LAZY = {"GenerationResult": "distvideo.outputs", "VideoGenerator": "distvideo.generator"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'distvideo' has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "DivergentCallError",
    "EngineConfig",
    "GenerationCancelled",
    "GenerationRequest",
    "GenerationResult",
    "GenerationTimeout",
    "LaunchEnvError",
    "LoraError",
    "ModelLoadError",
    "ProcessGroupBrokenError",
    "RankFailure",
    "ResolvedRequest",
    "VideoGenerator",
    "VideoWriteError",
    "WorkerDiedError",
    "__version__",
]
