"""`distvideo` command line: argument parsing and exit codes (0 ok, 2 bad input, 1 runtime failure)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from distvideo.config import ConfigError, EngineConfig, GenerationRequest, LoraSpec, load_config_file

EXIT_OK, EXIT_RUNTIME, EXIT_BAD_INPUT = 0, 1, 2

logger = logging.getLogger("distvideo.cli")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 too; keep our wording
        self.print_usage(sys.stderr)
        print(f"distvideo: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="distvideo", description="Distributed inference for video diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate a video from a text prompt")
    add_engine_arguments(gen)
    gen.add_argument("--prompt", help="what the video shows")
    gen.add_argument("--negative-prompt", dest="negative_prompt", help="what to steer away from (default: empty)")
    gen.add_argument("--num-frames", dest="num_frames", type=int, help="frames, of the form 4k+1")
    gen.add_argument("--height", type=int, help="pixels, a multiple of the model's spatial stride")
    gen.add_argument("--width", type=int, help="pixels, a multiple of the model's spatial stride")
    gen.add_argument("--steps", dest="num_inference_steps", type=int, help="denoising steps")
    gen.add_argument("--guidance-scale", dest="guidance_scale", type=float, help="CFG scale (<= 1 turns it off)")
    gen.add_argument("--seed", type=int, help="noise seed (default 0)")
    gen.add_argument("--fps", type=int, help="frames per second of the saved video (default 16)")
    gen.add_argument("--output", dest="output_path", help="a .mp4 file, or a folder (default: outputs/)")
    gen.add_argument("--config", help="YAML or JSON file with 'engine' and 'request' sections; flags override it")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    gen.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR")
    from distvideo.cli.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="diffusers-format checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--num-gpus", dest="num_gpus", type=int, help="number of ranks")
    p.add_argument("--executor", choices=["auto", "inline", "mp", "external"], help="how ranks exist")
    p.add_argument("--sp-size", dest="sp_size", type=int, help="sequence-parallel degree")
    p.add_argument("--cfg-parallel", dest="cfg_parallel", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--dist-timeout", dest="dist_timeout", type=_positive_float, help="seconds for collectives")
    p.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: automatic)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="transformer/text-encoder dtype")
    p.add_argument("--lora", action="append", metavar="PATH[:STRENGTH]", help="LoRA adapter; repeat to stack")


_ENGINE_FIELDS = ("model", "num_gpus", "executor", "sp_size", "cfg_parallel", "dist_timeout", "device", "dtype")
_REQUEST_FIELDS = (
    "prompt",
    "negative_prompt",
    "num_frames",
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "seed",
    "fps",
    "output_path",
)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, GenerationRequest]:
    """Config file first, then every flag that was given on the command line."""
    file_values: dict[str, dict[str, Any]] = {"engine": {}, "request": {}}
    if getattr(args, "config", None):
        file_values = load_config_file(args.config)
    engine = dict(file_values["engine"])
    request = dict(file_values["request"])
    for name in _ENGINE_FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            engine[name] = value
    if getattr(args, "lora", None):
        engine["lora"] = [LoraSpec.parse(text) for text in args.lora]
    for name in _REQUEST_FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            request[name] = value
    engine_config = EngineConfig(**engine)
    engine_config.validate()
    if not request.get("prompt"):
        raise ConfigError("--prompt: required (or 'request.prompt' in --config); e.g. --prompt 'a cat surfing'")
    gen_request = GenerationRequest(**request)
    gen_request.validate()
    return engine_config, gen_request


def cmd_generate(args: argparse.Namespace) -> int:
    from distvideo.generator import VideoGenerator

    engine_config, request = configs_from_args(args)
    if args.no_progress:
        from distvideo import envs

        envs.set_external({"DISTVIDEO_NO_PROGRESS": "1"})
    # check the request against the model's JSON files before any process starts or weight loads
    _, info = VideoGenerator.probe(engine_config)
    info.resolve_request(request)
    with VideoGenerator.from_config(engine_config) as gen:
        result = gen.generate_request(request)
        if gen.is_output_rank and result.video_path:
            print(result.video_path, flush=True)
    return EXIT_OK


class Terminated(KeyboardInterrupt):
    """SIGTERM (a launcher or scheduler stopping the job), handled like Ctrl-C so cleanup runs."""

    exit_code = 143


_HARD_EXIT_AFTER_S = 8.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_hard_exit_lock = threading.Lock()
_hard_exit_armed = False


def _arm_hard_exit(signum: int) -> None:
    """Cleanup (shutting down workers, destroying the process group) runs as the exception unwinds; if it is stuck
    (a peer that will never answer), end the process anyway so a stop never hangs. Armed once, by the first signal."""
    global _hard_exit_armed
    with _hard_exit_lock:
        if _hard_exit_armed:
            return
        _hard_exit_armed = True
    timer = threading.Timer(_HARD_EXIT_AFTER_S, os._exit, args=(128 + signum,))
    timer.daemon = True
    timer.start()


def _on_signal(signum: int, frame: Any) -> None:
    _arm_hard_exit(signum)
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


class _SignalWatch:
    """Arms the hard exit the moment a stop signal arrives, also while the main thread is blocked in native code (a
    collective waiting for a peer), where Python cannot run `_on_signal` until the call returns, which may be only at
    dist_timeout. The interpreter's C-level handler writes each signal's number to the wakeup fd at once; a thread
    reads it."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="distvideo-signal-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closing:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            for signum in data:
                if signum in _STOP_SIGNALS:
                    _arm_hard_exit(signum)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        self._closing = True
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"\0")  # wake the thread, which then leaves
        self._thread.join(timeout=1.0)
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def install_signal_handlers() -> dict[int, Any]:
    """Route SIGTERM and SIGINT through `_on_signal`, and watch for them (`_SignalWatch`); returns what
    `restore_signal_handlers` needs."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[Any, Any] = {sig: signal.signal(sig, _on_signal) for sig in _STOP_SIGNALS}
    try:
        previous["watch"] = _SignalWatch()
    except (OSError, ValueError):  # no pipe, or a wakeup fd this process cannot replace: the handlers still work
        pass
    return previous


def restore_signal_handlers(previous: dict[Any, Any]) -> None:
    watch = previous.pop("watch", None)
    if watch is not None:
        watch.close()
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    from distvideo.logging_utils import configure_logging

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    configure_logging(getattr(args, "log_level", None))
    previous_handlers = install_signal_handlers()
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            from distvideo.cli.bench import cmd_bench

            return cmd_bench(args)
        parser.error(f"unknown command {args.command!r}")
    except ConfigError as exc:
        print(f"distvideo: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        code = exc.exit_code if isinstance(exc, Terminated) else 130
        print(f"distvideo: interrupted ({'SIGTERM' if code == 143 else 'SIGINT'}); stopped", file=sys.stderr)
        return code
    except Exception as exc:
        logger.debug("failure", exc_info=True)
        print(f"distvideo: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        restore_signal_handlers(previous_handlers)
    return EXIT_OK
