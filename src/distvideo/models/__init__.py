"""Model families: which pipeline runs a checkpoint folder, and loading its components."""

from distvideo.models.registry import SUPPORTED_CLASSES, ModelInfo, probe_model

__all__ = ["SUPPORTED_CLASSES", "ModelInfo", "probe_model"]
