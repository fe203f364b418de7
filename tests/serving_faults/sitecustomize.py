"""Test-only fault injection for served engines (tests/test_serving_*.py): with DISTVIDEO_TEST_FAIL_RANK=N in the
environment (or "all"), the Wan pipeline raises on rank N (every rank) for prompts containing "inject a fault". Python imports this module at
start-up in every process whose PYTHONPATH starts with this folder: the server, its mp workers, launched ranks."""

import os

if os.environ.get("DISTVIDEO_TEST_FAIL_RANK"):
    import torch.distributed as dist

    from distvideo.pipelines import wan

    _FAIL_RANK = os.environ["DISTVIDEO_TEST_FAIL_RANK"]
    _original = wan.WanT2VPipeline.__call__

    def _call(self, request, *args, **kwargs):
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if "inject a fault" in request.prompt and _FAIL_RANK in ("all", str(rank)):
            raise RuntimeError(f"injected fault on rank {rank}")
        return _original(self, request, *args, **kwargs)

    wan.WanT2VPipeline.__call__ = _call
