"""The model families, one package each, registered on import (distvideo/__init__.py imports this package, so any
import of distvideo has them). Each package declares its families (models/family.py's ModelFamily) in its
``__init__`` and keeps its pipelines in modules of its own, which the worker imports when it loads one: declaring
costs no torch import. The order here is the order checkpoints are matched and families are listed in messages."""

from distvideo.families import wan

# isort: split
from distvideo.families import hunyuan15

__all__ = ["hunyuan15", "wan"]
