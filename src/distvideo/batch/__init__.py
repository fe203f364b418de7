"""Batch jobs: prompt files over data-parallel replicas, resumable (docs/batch.md). `items.py` reads and resolves the
items, `assign.py` balances them over the replicas, `manifest.py` records what finished, `run.py` runs the rest."""

from distvideo.batch.items import BatchItem, derive_seed, read_prompt_file
from distvideo.batch.manifest import MANIFEST, Manifest
from distvideo.batch.run import BatchPlan, BatchResult, plan_batch, run_batch

__all__ = [
    "MANIFEST",
    "BatchItem",
    "BatchPlan",
    "BatchResult",
    "Manifest",
    "derive_seed",
    "plan_batch",
    "read_prompt_file",
    "run_batch",
]
