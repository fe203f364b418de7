"""The service's own settings (`distvideo serve` flags beside the engine flags): where it listens, where videos and the
job store live, and the limits it enforces before a job is queued. No FastAPI here: building the command line must
stay cheap for every subcommand."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distvideo.errors import ConfigError
from distvideo.request import MAX_STEPS

DEFAULT_HOST = "127.0.0.1"  # loopback: nothing listens beyond this machine unless asked (--host)


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for, checked before it is queued (422 naming the field)."""

    max_frames: int = 257
    max_pixels: int = 1280 * 720
    max_steps: int = 200
    max_prompt_chars: int = 4000

    def validate(self) -> None:
        for name in ("max_frames", "max_pixels", "max_steps", "max_prompt_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
        if self.max_steps > MAX_STEPS:
            raise ConfigError(f"--max-steps={self.max_steps} is more than the engine takes (at most {MAX_STEPS} steps)")


@dataclass(frozen=True)
class ServeOptions:
    host: str = DEFAULT_HOST
    port: int = 8000  # 0: any free port (the bound one is printed)
    output: str = "outputs"  # videos and the job store
    api_key: str | None = None
    api_keys_file: str | None = None  # more keys, one per line: each is one client of the fair queue
    max_queue: int = 8
    max_body_bytes: int = 16 * 1024 * 1024
    shutdown_grace: float = 20.0
    lora_adapters: dict[str, str] = field(default_factory=dict)  # request-selectable adapters: name -> file
    limits: ServeLimits = field(default_factory=ServeLimits)

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port={self.port} must be between 0 (any free port) and 65535")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue={self.max_queue} must be >= 1 (jobs waiting while one runs)")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes={self.max_body_bytes} must be >= 1024")
        if not (math.isfinite(self.shutdown_grace) and self.shutdown_grace >= 0):
            raise ConfigError(f"--shutdown-grace={self.shutdown_grace} must be a finite number of seconds >= 0")
        if self.api_key is not None and len(self.api_key) < 8:
            raise ConfigError("--api-key: use at least 8 characters (DISTVIDEO_API_KEY can hold it instead)")
        self.api_keys()
        self.limits.validate()

    def api_keys(self) -> tuple[str, ...]:
        """Every key a request may bring: `--api-key`, then the lines of `--api-keys-file` (blank lines and lines
        starting with # are skipped). Empty: no key is required."""
        keys = [self.api_key] if self.api_key else []
        if self.api_keys_file is not None:
            keys += _read_keys(Path(self.api_keys_file))
        if len(set(keys)) != len(keys):
            raise ConfigError("--api-keys-file: a key is given twice (each key is one client)")
        return tuple(keys)


def _read_keys(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-keys-file {path}: cannot read it ({exc})") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ConfigError(f"--api-keys-file {path}: no key in it (one key per line)")
    for number, key in enumerate(keys, 1):
        if len(key) < 8 or any(c.isspace() for c in key):
            raise ConfigError(f"--api-keys-file {path}: key {number} must be 8 or more characters without spaces")
    return keys


def _adapter(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a LoRA file a request may name), got {text!r}")
    return name, path


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d, limits = ServeOptions(), ServeLimits()
    group = parser.add_argument_group("service")
    group.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host}: this machine only)")
    group.add_argument("--port", type=int, default=d.port, help=f"TCP port (default {d.port}; 0: any free port)")
    group.add_argument("--output", default=d.output, help="folder for the videos and the job store (default outputs/)")
    group.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: DISTVIDEO_API_KEY, or none)")
    group.add_argument(
        "--api-keys-file",
        metavar="PATH",
        help="more keys, one per line; jobs are taken round-robin across keys, so no client starves another",
    )
    group.add_argument("--max-queue", type=int, default=d.max_queue, help="jobs that may wait; more get 429")
    group.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body (413)")
    group.add_argument(
        "--shutdown-grace",
        type=float,
        default=d.shutdown_grace,
        help="seconds the running job gets to finish after SIGTERM before it is cancelled (default 20)",
    )
    group.add_argument(
        "--lora-adapter",
        action="append",
        type=_adapter,
        default=[],
        metavar="NAME=PATH",
        help="a LoRA file requests may choose by NAME ('lora': {'name': NAME, 'strength': S}); repeat",
    )
    group.add_argument("--max-frames", type=int, default=limits.max_frames, help="most frames a request may ask for")
    group.add_argument("--max-pixels", type=int, default=limits.max_pixels, help="most width x height per frame")
    group.add_argument("--max-steps", type=int, default=limits.max_steps, help="most denoising steps per request")


def options_from_args(args: argparse.Namespace, api_key_default: str | None = None) -> ServeOptions:
    adapters: dict[str, str] = {}
    for name, path in args.lora_adapter:
        if name in adapters:
            raise ConfigError(f"--lora-adapter {name}=...: the name {name!r} is given twice")
        adapters[name] = path
    options = ServeOptions(
        host=args.host,
        port=args.port,
        output=args.output,
        api_key=args.api_key or api_key_default or None,
        api_keys_file=args.api_keys_file,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace=args.shutdown_grace,
        lora_adapters=adapters,
        limits=ServeLimits(max_frames=args.max_frames, max_pixels=args.max_pixels, max_steps=args.max_steps),
    )
    options.validate()
    return options


def describe(options: ServeOptions) -> dict[str, Any]:
    """The options as logged at start-up (never the key itself)."""
    return {
        "host": options.host,
        "port": options.port,
        "output": options.output,
        "api_keys": len(options.api_keys()),
        "max_queue": options.max_queue,
    }
