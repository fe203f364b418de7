"""Builders of random-weight checkpoints and LoRA files for tests, benchmarks and scripts. Nothing at run time imports
this package."""
