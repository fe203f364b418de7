"""A Hugging Face repo id as `--model`: the checkpoint comes from huggingface_hub's own cache, downloaded into it once.

``--model Wan-AI/Wan2.2-TI2V-5B-Diffusers`` (anything that is not an existing path and looks like ``owner/name``)
resolves to the snapshot folder of that repo in the hub cache (``HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``), which holds the diffusers folder layout. When the cache has it, nothing touches the
network, and with ``HF_HUB_OFFLINE=1`` nothing ever does. When it is missing (and the hub is reachable), it is
downloaded with ``huggingface_hub.snapshot_download``: under a launcher every rank of a node resolves the model at
the same time, so the download runs under a file lock in the cache folder, and the first rank to take it downloads
while the others wait, then find the snapshot in the cache (one download per node, or per shared cache).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from distvideo.errors import ConfigError
from distvideo.models.embedded import SHIPPED_MODELS

logger = logging.getLogger(__name__)

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def looks_like_repo_id(model: str) -> bool:
    """`owner/name` with the hub's characters, and no path syntax (a leading '/', '.', '~')."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model and not model.endswith((".", "-"))


def resolve_model(model: str) -> str:
    """The local folder of `model`: itself when it exists (or is not a repo id: the registry says what is wrong
    with it), else the hub cache's snapshot of the repo id, downloaded first when missing and allowed."""
    if Path(model).expanduser().exists():
        return model
    if model in SHIPPED_MODELS:  # a model shipped in the package, by name: demo, demo-4step
        return str(SHIPPED_MODELS[model])
    if not looks_like_repo_id(model):
        return model
    cached = _cached_snapshot(model)
    if cached is not None:
        logger.debug("--model %s: the hub cache's snapshot %s", model, cached)
        return cached
    import huggingface_hub

    if huggingface_hub.is_offline_mode():
        raise ConfigError(
            f"--model {model}: no such folder, and the repo is not in the Hugging Face cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is set; download it first "
            f"(`hf download {model}`), point HF_HUB_CACHE (or HF_HOME) at the cache that holds it, or unset "
            "HF_HUB_OFFLINE"
        )
    return _download_once(model)


def _cached_snapshot(repo_id: str) -> str | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None
    return str(path)


def _download_once(repo_id: str) -> str:
    """Download under a lock in the cache folder: the ranks of a node take turns, and only the first downloads."""
    import huggingface_hub
    from filelock import FileLock
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    cache = Path(huggingface_hub.constants.HF_HUB_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f".distvideo-{repo_id.replace('/', '--')}.lock")):
        cached = _cached_snapshot(repo_id)  # a rank that held the lock before this one downloaded it
        if cached is not None:
            return cached
        logger.info("downloading %s into the Hugging Face cache %s", repo_id, cache)
        try:
            return str(huggingface_hub.snapshot_download(repo_id))
        except RepositoryNotFoundError:
            raise ConfigError(
                f"--model {repo_id}: no such folder, and no such repo on the Hugging Face Hub (or it is private: "
                "log in with `hf auth login`)"
            ) from None
        except (HfHubHTTPError, OSError) as exc:
            raise ConfigError(
                f"--model {repo_id}: not in the Hugging Face cache and the download failed ({type(exc).__name__}: "
                f"{exc}); download it where the hub is reachable (`hf download {repo_id}`) and share the cache"
            ) from None
