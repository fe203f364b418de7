"""Test-only hooks for served engines (tests/test_serving_*.py). Python imports this module at start-up in every
process whose PYTHONPATH starts with this folder: the server, its mp workers, launched ranks.

- DISTVIDEO_TEST_FAIL_RANK=N (or "all"): every family's pipeline raises on rank N (every rank) for prompts containing
  "inject a fault".
- DISTVIDEO_TEST_SLOW_STEP_S=S: every rank sleeps S seconds after each denoising step of a job of 100 steps or more,
  so a "long" job outlasts a grace period or a cancel whatever the machine's speed (a tiny model's step can take
  2 ms), while short jobs run at full speed.
"""

import os

if os.environ.get("DISTVIDEO_TEST_FAIL_RANK"):
    import torch.distributed as dist

    from distvideo.pipelines import base

    _FAIL_RANK = os.environ["DISTVIDEO_TEST_FAIL_RANK"]
    _original = base.DenoisingPipeline.__call__

    def _call(self, request, *args, **kwargs):
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if "inject a fault" in request.prompt and _FAIL_RANK in ("all", str(rank)):
            raise RuntimeError(f"injected fault on rank {rank}")
        return _original(self, request, *args, **kwargs)

    base.DenoisingPipeline.__call__ = _call

if os.environ.get("DISTVIDEO_TEST_SLOW_STEP_S"):
    import time

    from distvideo.pipelines import control

    _SLOW_S = float(os.environ["DISTVIDEO_TEST_SLOW_STEP_S"])
    _after_step = control.StepControl.after_step

    def _slow_after_step(self, done, total):
        if total >= 100:
            time.sleep(_SLOW_S)
        return _after_step(self, done, total)

    control.StepControl.after_step = _slow_after_step

if os.environ.get("DISTVIDEO_TEST_HOLD_FILE"):
    import time
    from pathlib import Path

    from distvideo.pipelines import control

    _RELEASE = Path(os.environ["DISTVIDEO_TEST_HOLD_FILE"])
    _before_hold = control.StepControl.after_step

    def _held_after_step(self, done, total):
        _before_hold(self, done, total)  # progress reported, no stop decided: the job is running
        deadline = time.monotonic() + 600  # never forever: a test that failed kills the server anyway
        while total == 7 and done == 1 and not _RELEASE.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    control.StepControl.after_step = _held_after_step

if os.environ.get("DISTVIDEO_TEST_HARD_EXIT_MARGIN_S"):
    from distvideo.serving import server

    server.HARD_EXIT_MARGIN_S = float(os.environ["DISTVIDEO_TEST_HARD_EXIT_MARGIN_S"])
