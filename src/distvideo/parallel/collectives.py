"""The one wrapper every collective of ours runs in: a failure surfaces as CollectiveError, a type the executors decide
on (a broken process group), instead of the backend's own (gloo raises plain RuntimeErrors, NCCL DistBackendErrors).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from distvideo.errors import CollectiveError


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Run collectives (or waits on them) inside; any failure is re-raised as CollectiveError naming `what`."""
    try:
        yield
    except CollectiveError:
        raise
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(f"{what}: {type(exc).__name__}: {exc}") from exc
