"""Parallel inference: the cfg x sp layout (layout.py), its process groups (groups.py), Ulysses sequence parallelism
(ulysses.py) with ring attention under USP (ring.py), CFG parallelism (cfg.py), the exact banded VAE decode
(vae.py), and the ParallelContext a pipeline talks to (context.py). See docs/parallel.md. Importing the package (or layout.py) does not import torch."""

from distvideo.parallel.layout import ParallelLayout, resolve_layout

__all__ = ["ParallelLayout", "resolve_layout"]
