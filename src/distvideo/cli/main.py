"""`distvideo` command line: argument parsing and exit codes (0 ok, 2 bad input, 1 runtime failure)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from distvideo.cli.arguments import (
    add_engine_arguments,
    add_request_arguments,
    configs_from_args,
    request_fields_given,
)
from distvideo.cli.signals import Terminated, install_signal_handlers, restore_signal_handlers
from distvideo.errors import ConfigError

EXIT_OK, EXIT_RUNTIME, EXIT_BAD_INPUT = 0, 1, 2

logger = logging.getLogger("distvideo.cli")

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_RUNTIME", "build_parser", "configs_from_args", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 too; keep our wording
        self.print_usage(sys.stderr)
        print(f"distvideo: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    from distvideo.bench import add_bench_parser

    parser = _Parser(prog="distvideo", description="Distributed inference for video diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate a video from a text prompt")
    add_engine_arguments(gen)
    add_request_arguments(gen)
    add_bench_parser(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from distvideo.executors import resolve_engine
    from distvideo.generator import VideoGenerator

    engine_config, request = configs_from_args(args)
    engine = resolve_engine(engine_config)
    if "fps" not in request_fields_given(args):
        request = dataclasses.replace(request, fps=int(engine.model.defaults.get("fps", request.fps)))
    # check the request against the model's JSON files before any process starts or weight loads; under a launcher
    # the image file is read later, on every rank at once, so a file missing on one node is refused on all of them
    # (exiting here on that node alone would leave the others waiting for it at the rendezvous)
    request = engine.model.resolve_request(request, read_image=engine.executor != "external")
    with VideoGenerator.from_engine(engine) as gen:
        result = gen.generate_request(request)
        if gen.is_output_rank and result.video_path:
            print(result.video_path, flush=True)
    return EXIT_OK


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
            from distvideo.bench import cmd_bench

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
