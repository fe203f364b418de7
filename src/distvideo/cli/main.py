"""`distvideo` command line: argument parsing and exit codes (0 ok, 2 bad input, 1 runtime failure)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from distvideo.cli.arguments import (
    add_engine_arguments,
    add_request_arguments,
    configs_from_args,
    engine_config_from_args,
)
from distvideo.cli.signals import Terminated, install_signal_handlers, restore_signal_handlers
from distvideo.errors import ConfigError, VideoWriteError

EXIT_OK, EXIT_RUNTIME, EXIT_BAD_INPUT = 0, 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # a Unix tool whose reader went away ends by SIGPIPE: `yes | head` gives 141

logger = logging.getLogger("distvideo.cli")

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_RUNTIME", "build_parser", "configs_from_args", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 too; keep our wording
        self.print_usage(sys.stderr)
        print(f"distvideo: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    from distvideo.bench.plan import add_bench_parser

    parser = _Parser(prog="distvideo", description="Distributed inference for video diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate a video from a text prompt, or one per line of a prompt file")
    add_engine_arguments(gen)
    add_request_arguments(gen)
    gen.add_argument(
        "--prompts",
        metavar="FILE",
        help="a batch: one prompt per line, or JSONL objects; videos and manifest.jsonl go into --output (a folder)",
    )
    gen.add_argument("--batch-seed", dest="batch_seed", type=int, default=0, help="seeds of items without one")
    add_bench_parser(sub)
    from distvideo.cli.calibrate import add_calibrate_parser

    add_calibrate_parser(sub)
    from distvideo.cli.plan import add_plan_parser

    add_plan_parser(sub)
    from distvideo.serving.options import add_serve_arguments

    srv = sub.add_parser("serve", help="serve the HTTP video API (OpenAI-style /v1/videos) on this engine")
    add_engine_arguments(srv)
    add_serve_arguments(srv)
    return parser


def cmd_batch(args: argparse.Namespace) -> int:
    """`generate --prompts FILE`: exit 0 when every item is done, 1 when some failed (with a summary)."""
    from distvideo.batch import read_prompt_file
    from distvideo.batch.run import plan_batch, record_refused, run_batch
    from distvideo.executors import resolve_engine
    from distvideo.generator import VideoGenerator

    if args.prompt is not None:
        raise ConfigError("--prompt and --prompts: give one prompt or a prompt file, not both")
    args.prompt = "-"  # each item brings its own
    engine_config, defaults = configs_from_args(args)
    folder = defaults.output_path or "outputs"  # --output, else the config file's request.output_path
    if folder.lower().endswith(".mp4"):
        raise ConfigError(f"--output {folder}: with --prompts, --output is a folder for the videos and the manifest")
    engine = resolve_engine(engine_config, objective="throughput")  # many items: replicas count (layout auto)
    raw = read_prompt_file(args.prompts)
    _refuse_an_ignored_seed(args, raw)
    # every item checked, and the manifest read, before any process starts or weight loads
    plan = plan_batch(raw, engine.model, folder=folder, defaults=defaults, batch_seed=args.batch_seed)
    results = None
    if not plan.todo and plan.invalid:
        record_refused(plan)
    if plan.todo:
        with VideoGenerator.from_engine(engine) as gen:
            results = run_batch(gen, plan, progress=bool(engine.config.progress))
            if not gen.is_output_rank:
                return EXIT_OK
    done = len(plan.finished) + sum(1 for r in results or [] if r.status == "done" and not r.resumed)
    failed = len(plan.items) - done
    print(
        f"batch: {done} done ({len(plan.finished)} from earlier runs), {failed} failed, of {len(plan.items)}; "
        f"manifest: {plan.folder / 'manifest.jsonl'}",
        flush=True,
    )
    return EXIT_OK if failed == 0 else EXIT_RUNTIME


def _refuse_an_ignored_seed(args: argparse.Namespace, raw: list[dict[str, Any]]) -> None:
    """A batch item without a seed of its own gets one from --batch-seed and its index (docs/batch.md), not from
    --seed (or the config file's request.seed), which would then be ignored without a word: refused instead. An item
    with its own seed overrides the flag, as its other fields do."""
    from distvideo.config_files import load_config_file

    given = f"--seed {args.seed}" if args.seed is not None else None
    if given is None and args.config and "seed" in load_config_file(args.config)["request"]:
        given = f"--config {args.config}: 'request.seed'"
    unseeded = next((n for n, item in enumerate(raw) if "_error" not in item and item.get("seed") is None), None)
    if given is not None and unseeded is not None:
        raise ConfigError(
            f"{given} with --prompts: item {unseeded} has no seed of its own, and a batch item gets it from "
            "--batch-seed (default 0) and its index, not from --seed; use --batch-seed instead, or give every item "
            'its own "seed" in a JSONL prompt file'
        )


def cmd_generate(args: argparse.Namespace) -> int:
    if getattr(args, "prompts", None):
        return cmd_batch(args)
    from distvideo.executors import resolve_engine
    from distvideo.generator import VideoGenerator
    from distvideo.media import FRAMES_ON_ERROR, check_video_output

    engine_config, request = configs_from_args(args)
    engine = resolve_engine(engine_config)
    # check the request against the model's JSON files before any process starts or weight loads; under a launcher
    # the image file is read later, on every rank at once, so a file missing on one node is refused on all of them
    # (exiting here on that node alone would leave the others waiting for it at the rendezvous)
    launched = engine.executor == "external"
    resolved = engine.model.resolve_request(request, read_image=not launched)
    if resolved.save_video and engine.launch is None:  # where its video would go, too (launched ranks: later, together)
        check_video_output(
            resolved.output_path,
            resolved.prompt,
            resolved.seed,
            resolved.width,
            resolved.height,
            resolved.fps,
            "--output",
        )
    with VideoGenerator.from_engine(engine) as gen:
        try:  # launched ranks with an image resolve the request together, each reading the image (which may size it)
            result = gen.generate_request(request if launched and request.image is not None else resolved)
        except VideoWriteError as exc:
            if exc.frames_path is None:  # the frames live only on the error, which ends with this command
                raise VideoWriteError(str(exc).removesuffix(FRAMES_ON_ERROR) + "; the frames are lost") from exc
            raise
        if gen.is_output_rank and result.video_path:
            print(result.video_path, flush=True)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs until a stop signal (0) or an engine failure (1); handles SIGTERM/SIGINT itself (graceful shutdown)."""
    from distvideo import envs
    from distvideo.serving.admission import PRESETTABLE
    from distvideo.serving.options import options_from_args

    engine_config, request_section = engine_config_from_args(args)
    ignored = sorted(set(request_section) - set(PRESETTABLE))
    if ignored:
        raise ConfigError(
            f"--config {args.config}: 'request.{ignored[0]}' cannot be preset for a server; presettable: "
            f"{', '.join(PRESETTABLE)} (each request brings its prompt; the server names the files)"
        )
    options = options_from_args(args, api_key_default=envs.get("DISTVIDEO_API_KEY"))
    from distvideo.serving.server import serve  # after the options are checked: bad input exits 2 without torch

    return serve(engine_config, options, presets=request_section)


def _reader_gone() -> int:
    """Standard output's reader closed it (`distvideo plan --json | head`): end quietly, as Unix tools do. What is
    still buffered cannot be written, and Python would report that at exit; stdout points at /dev/null instead."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    from distvideo.logging_utils import configure_logging

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    configure_logging(getattr(args, "log_level", None))
    # serve stops gracefully on SIGTERM/SIGINT with handlers of its own (distvideo.serving.lifecycle)
    previous_handlers = install_signal_handlers() if args.command != "serve" else {}
    try:
        code = _run_command(parser, args)
        sys.stdout.flush()  # a closed pipe shows here (the buffer's last write), not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _reader_gone()
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


def _run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "calibrate":
        from distvideo.cli.calibrate import cmd_calibrate

        return cmd_calibrate(args)
    if args.command == "plan":
        from distvideo.cli.plan import cmd_plan

        return cmd_plan(args)
    if args.command == "bench":
        from distvideo.bench.plan import plan_from_args

        plan = plan_from_args(args)  # bad input exits 2 here, before torch is imported or any weight loads
        from distvideo.bench.run import cmd_bench

        return cmd_bench(args, plan)
    parser.error(f"unknown command {args.command!r}")
    return EXIT_BAD_INPUT
