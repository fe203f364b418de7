"""The libraries a rank imports to load and run the registered families, imported once by the mp executor's fork server
(executors/mp_start.py) so that the workers it forks start without importing it again (about 4 s of CPU per rank).

Importing is all this module does: no torch operation runs, no file is read and no thread is started, so a process
forked after it is as clean as one spawned. A name a library lacks (another version) is skipped: the worker that
needs it imports it and reports the error.
"""

from __future__ import annotations

import contextlib
import importlib

#: (module, names) every family loads with: diffusers' LoRA loaders and hooks pull in PEFT; PyAV writes the video.
#: Each family adds what its model_index.json files name (ModelFamily.libraries).
SHARED_LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (("peft", ("LoraConfig",)), ("av", ("open",)))


def _import_all() -> None:
    from distvideo.models import compat

    compat.defer_torchao()  # as loading does: the libraries import no torchao (a mode that needs it imports it)
    from distvideo.models.family import registered_families

    libraries = [*(entry for family in registered_families() for entry in family.libraries), *SHARED_LIBRARIES]
    for module_name, names in dict.fromkeys(libraries):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(module_name)
            for name in names:
                with contextlib.suppress(AttributeError, ImportError):
                    getattr(module, name)


_import_all()
