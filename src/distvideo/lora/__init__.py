"""LoRA adapters: reading the file formats published for Wan, and applying, merging, unmerging and stacking them on
every rank's transformer as one transaction (see docs/lora.md)."""

from distvideo.lora.formats import LoraError, LoraFile, LoraLayerWeights, diffusers_layer_name, read_lora_file
from distvideo.lora.layers import LoraAdapter, LoraState, check_against_model, linear_layers
from distvideo.lora.rank import transformer_digest

__all__ = [
    "LoraAdapter",
    "LoraError",
    "LoraFile",
    "LoraLayerWeights",
    "LoraState",
    "check_against_model",
    "diffusers_layer_name",
    "linear_layers",
    "read_lora_file",
    "transformer_digest",
]
