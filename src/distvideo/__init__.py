"""distvideo: run video diffusion transformers on one or many devices, under torchrun, srun, mpirun
or its own worker processes."""

from distvideo import envs

envs.reproducible_cpu_math()  # before anything computes: MKL reads its mode once (envs.MKL_REPRODUCIBLE)

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
from distvideo.generator import GenerationResult, VideoGenerator  # noqa: E402
from distvideo.request import GenerationRequest  # noqa: E402

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
