"""The libraries a rank imports to load and run the registered families, imported once by the mp executor's fork server
(executors/mp_start.py) so that the workers it forks start without importing it again (about 4 s of CPU per rank).

Importing is all this module does: no torch operation runs, no file is read and no thread is started, so a process
forked after it is as clean as one spawned. A name a library lacks (another version) is skipped: the worker that
needs it imports it and reports the error.
"""

from __future__ import annotations

import contextlib
import importlib

#: (module, names): the classes the registered families' model_index.json files name, and what loading them pulls
#: in (diffusers' LoRA loaders and hooks, PEFT, PyAV)
LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Wan2.1 / Wan2.2 (models/registry.py)
    ("diffusers", ("WanTransformer3DModel", "AutoencoderKLWan", "UniPCMultistepScheduler")),
    ("diffusers", ("FlowMatchEulerDiscreteScheduler", "WanPipeline")),
    ("transformers", ("UMT5EncoderModel", "T5TokenizerFast", "CLIPVisionModel")),
    # HunyuanVideo 1.5 (families/hunyuan15/)
    ("diffusers", ("HunyuanVideo15Transformer3DModel", "AutoencoderKLHunyuanVideo15", "ClassifierFreeGuidance")),
    ("transformers", ("Qwen2_5_VLTextModel", "T5EncoderModel", "Qwen2Tokenizer", "ByT5Tokenizer", "SiglipVisionModel")),
    ("peft", ("LoraConfig",)),
    ("av", ("open",)),
)


def _import_all() -> None:
    from distvideo.models import compat

    compat.defer_torchao()  # as loading does: the libraries import no torchao (a mode that needs it imports it)
    for module_name, names in LIBRARIES:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(module_name)
            for name in names:
                with contextlib.suppress(AttributeError, ImportError):
                    getattr(module, name)


_import_all()
