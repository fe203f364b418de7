"""distvideo: run video diffusion transformers on one or many devices, under torchrun, srun, mpirun
or its own worker processes."""

from distvideo.config import EngineConfig, GenerationRequest
from distvideo.errors import (
    ConfigError,
    DivergentCallError,
    LaunchEnvError,
    LoraError,
    ModelLoadError,
    ProcessGroupBrokenError,
    RankFailure,
    WorkerDiedError,
)
from distvideo.generator import GenerationResult, VideoGenerator

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "DivergentCallError",
    "EngineConfig",
    "GenerationRequest",
    "GenerationResult",
    "LaunchEnvError",
    "LoraError",
    "ModelLoadError",
    "ProcessGroupBrokenError",
    "RankFailure",
    "VideoGenerator",
    "WorkerDiedError",
    "__version__",
]
