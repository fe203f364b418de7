"""Builders of random-weight checkpoints and LoRA files for tests, benchmarks and scripts. Nothing at run time imports
this package."""

from distvideo.models import compat

compat.defer_torchao()  # the builders construct diffusers and transformers models (see there)
