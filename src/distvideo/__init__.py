"""distvideo: run video diffusion transformers on one or many devices, under torchrun, srun, mpirun
or its own worker processes."""

from distvideo.config import EngineConfig, GenerationRequest
from distvideo.errors import (
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
from distvideo.generator import GenerationResult, VideoGenerator

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
    "VideoGenerator",
    "VideoWriteError",
    "WorkerDiedError",
    "__version__",
]
