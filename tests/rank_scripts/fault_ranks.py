"""Run by every rank (2 ranks, external executor): one fault scenario, with what each rank saw written to OUT_DIR.

usage: fault_ranks.py OUT_DIR SCENARIO [LORA_FILE | ARGS...]

Every rank writes OUT_DIR/start_at<rank> before it creates its generator and OUT_DIR/pid<rank> once it is ready. A rank that is about to kill itself writes
OUT_DIR/killed_at (time.time()); a rank that ends with an exception writes OUT_DIR/error<rank>.txt (its message) and
OUT_DIR/exit_at<rank>, then re-raises it (exit code 1). Scenarios:

- ``peer_dies``: first the refusals that must leave the group usable (divergent seed, shape, a request invalid on
  rank 1 only, divergent LoRA calls) and the timeouts of every process group, written to OUT_DIR/checks<rank>.json,
  with the transformer's call count (0: nothing was denoised); then rank 1 SIGKILLs itself in its 2nd transformer
  call of a generation, while rank 0 is in the per-step CFG all-gather.
- ``output_rank_dies``: rank 0 SIGKILLs itself in the middle of encoding the video into OUT_DIR/video/; rank 1 is
  already in its next call.
- ``stuck``: rank 1 sleeps dist_timeout + 5 s inside a collective_rpc callable while rank 0 waits in the status
  exchange.
- ``fails_alone``: rank 1 writes OUT_DIR/failed_at and raises in its 2nd transformer call (an error of its own,
  not a death) while rank 0 waits for it in the CFG all-gather; dist_timeout is LONE_FAILURE_DIST_TIMEOUT (600 s).
- ``never_joins``: only creates the generator (the test starts one rank of two; the other never comes).
- ``slow_cli``: the `distvideo generate` command (ARGS after the scenario); with FAULT_SLOW_TRANSFORMER_S set in the
  environment every transformer call sleeps that long and prints "step <rank>", for the tests that interrupt it.
- ``mp_faults``: not under a launcher: an mp generator whose rank 1 dies mid-generation, then ``slow_cli`` with ARGS.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

REQUEST = dict(num_frames=5, height=32, width=32, num_inference_steps=3, seed=0, max_sequence_length=16)
DIST_TIMEOUT = 10.0
#: ``fails_alone`` runs with a dist_timeout no test waits for: its rank 0 must be released by rank 1 leaving the group
LONE_FAILURE_DIST_TIMEOUT = 600.0


def die() -> None:
    (OUT / "killed_at").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def install_hook(worker: Any, victim: int, at_call: int, action: str) -> None:
    """Count transformer calls; on rank `victim`, `action` ("die" or "raise") at call number `at_call`."""
    worker.transformer_calls = 0

    def hook(module: Any, args: Any, output: Any) -> None:
        worker.transformer_calls += 1
        if worker.rank == victim and worker.transformer_calls == at_call:
            if action == "die":
                die()
            (OUT / "failed_at").write_text(repr(time.time()))
            raise RuntimeError(f"planted failure in transformer call {at_call} on rank {victim}")

    worker.pipeline.transformer.register_forward_hook(hook)


def transformer_calls(worker: Any) -> int:
    return worker.transformer_calls


def group_timeouts(worker: Any) -> dict[str, float]:
    """The timeout (s) of every process group this rank uses: the default group and the layout's subgroups."""
    groups = worker.parallel.groups
    named = {"world": torch.distributed.group.WORLD, "cpu": worker.cpu_group, "cfg": groups.cfg, "sp": groups.sp}
    out = {}
    for name, group in named.items():
        if group is not None:
            out[name] = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    return out


def sleep_on_rank_1(worker: Any, seconds: float) -> int:
    if worker.rank == 1:
        time.sleep(seconds)
    return worker.rank


def refused(fn: Any) -> str | None:
    """The message of the DivergentCallError `fn` raised, or None if it did not raise one."""
    from distvideo.executors.external import DivergentCallError

    try:
        fn()
    except DivergentCallError as exc:
        return str(exc)
    return None


def peer_dies(gen: Any, rank: int, lora: str) -> None:
    gen.collective_rpc(install_hook, args=(1, 2, "die"))
    checks: dict[str, Any] = {"timeouts": gen.collective_rpc(group_timeouts)}
    checks["seed"] = refused(lambda: gen.generate("a fox", **{**REQUEST, "seed": rank}))
    checks["shape"] = refused(lambda: gen.generate("a fox", **{**REQUEST, "height": 32 + 16 * rank}))
    checks["invalid_on_one_rank"] = refused(lambda: gen.generate("a fox", **{**REQUEST, "height": 32 + 18 * rank}))
    checks["lora_nickname"] = refused(lambda: gen.set_lora_adapter(f"style{rank}", lora))
    checks["lora_strength"] = refused(lambda: gen.set_lora_adapter("style", lora, strength=1.0 + rank))
    checks["transformer_calls"] = gen.collective_rpc(transformer_calls)
    checks["ping"] = gen.collective_rpc("ping")
    (OUT / f"checks{rank}.json").write_text(json.dumps(checks))
    gen.generate("a fox", save_video=False, **REQUEST)


def output_rank_dies(gen: Any, rank: int) -> None:
    import distvideo.media

    def encode_then_die(frames: Any, file: Any, fps: int) -> None:
        file.write(b"\0" * 4096)  # a partial video, as a crash in the middle of encoding leaves it
        file.flush()
        die()

    distvideo.media._encode_mp4 = encode_then_die
    gen.generate("a fox", output_path=str(OUT / "video" / "fox.mp4"), **REQUEST)
    gen.collective_rpc("ping")  # rank 1 (rank 0 never returns from generate)


def stuck(gen: Any, rank: int) -> None:
    (OUT / f"call_at{rank}").write_text(repr(time.time()))
    gen.collective_rpc(sleep_on_rank_1, args=(DIST_TIMEOUT + 5,))


def fails_alone(gen: Any, rank: int) -> None:
    gen.collective_rpc(install_hook, args=(1, 2, "raise"))
    gen.generate("a fox", save_video=False, **REQUEST)


def slow_down_transformer(seconds: float) -> None:
    """From now on every Worker's transformer sleeps `seconds` per call and prints "step <rank>" (flushed)."""
    from distvideo import worker as worker_module

    load_model = worker_module.Worker.load_model

    def load_slow_model(self: Any) -> None:
        load_model(self)

        def slow(module: Any, args: Any) -> None:
            print(f"step {self.rank}", flush=True)
            time.sleep(seconds)

        self.pipeline.transformer.register_forward_pre_hook(slow)

    worker_module.Worker.load_model = load_slow_model  # type: ignore[method-assign]


def mp_faults(argv: list[str]) -> int:
    """The mp executor, in one driver: first (API) a 2-rank generator whose rank 1 SIGKILLs itself in its 2nd
    transformer call, which must raise in the driver naming it (printed: "workers [pids]", then "died <time> <error>");
    then (CLI) `distvideo generate ARGV` for the test to interrupt."""
    from distvideo import VideoGenerator
    from distvideo.cli.main import main

    gen = VideoGenerator.from_pretrained(num_gpus=2, executor="mp", dist_timeout=DIST_TIMEOUT)
    print(f"workers {json.dumps(gen.collective_rpc(lambda worker: os.getpid()))}", flush=True)
    gen.collective_rpc(install_hook, args=(1, 2, "die"))
    try:
        gen.generate("a fox", save_video=False, **REQUEST)
        outcome = "nothing was raised"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print(f"died {time.time()!r} {outcome}".replace("\n", " "), flush=True)
    gen.shutdown()
    return main(["generate", *argv])


def run(scenario: str, extra: list[str]) -> None:
    from distvideo import VideoGenerator
    from distvideo.cli.main import main
    from distvideo.launch import resolve_launch_env

    if scenario == "slow_cli":
        sys.exit(main(["generate", *extra]))
    if scenario == "mp_faults":
        sys.exit(mp_faults(extra))
    rank = resolve_launch_env(dict(os.environ)).rank
    (OUT / f"start_at{rank}").write_text(repr(time.time()))
    try:
        timeout = LONE_FAILURE_DIST_TIMEOUT if scenario == "fails_alone" else DIST_TIMEOUT
        gen = VideoGenerator.from_pretrained(executor="external", dist_timeout=timeout)
        rank = gen.executor.rank
        (OUT / f"pid{rank}").write_text(str(os.getpid()))
        if scenario == "peer_dies":
            peer_dies(gen, rank, extra[0])
        elif scenario == "output_rank_dies":
            output_rank_dies(gen, rank)
        elif scenario == "stuck":
            stuck(gen, rank)
        elif scenario == "fails_alone":
            fails_alone(gen, rank)
        elif scenario != "never_joins":
            raise SystemExit(f"unknown scenario {scenario!r}")
    except Exception as exc:
        (OUT / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        (OUT / f"exit_at{rank}").write_text(repr(time.time()))
        raise
    (OUT / f"done{rank}").write_text("")


# spawned mp workers import this file too (as __mp_main__): the slow-down reaches them through the environment
if os.environ.get("FAULT_SLOW_TRANSFORMER_S"):
    slow_down_transformer(float(os.environ["FAULT_SLOW_TRANSFORMER_S"]))


if __name__ == "__main__":
    OUT = Path(sys.argv[1])
    run(sys.argv[2], sys.argv[3:])
