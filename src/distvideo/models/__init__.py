"""Model families: which pipeline runs a checkpoint folder, and loading its components."""

from distvideo.models.registry import ModelInfo, probe_model, supported_classes

__all__ = ["ModelInfo", "probe_model", "supported_classes"]
