"""distvideo: run video diffusion transformers on one or many devices, under torchrun, srun, mpirun
or its own worker processes."""

from distvideo.config import ConfigError, EngineConfig, GenerationRequest
from distvideo.generator import GenerationResult, VideoGenerator

__version__ = "0.1.0"
__all__ = ["ConfigError", "EngineConfig", "GenerationRequest", "GenerationResult", "VideoGenerator", "__version__"]
