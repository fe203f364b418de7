"""Command-line flags generated from the config dataclasses, shared by every subcommand (generate, bench, serve).

Each flag comes from one field of EngineConfig or GenerationRequest: its name (``num_gpus`` -> ``--num-gpus``, or the
shorter flag of config.ALIASES, ``--steps``, which the dashed name also answers to), its type, its choices (the
constants in distvideo.config) and its help (the field's metadata), so a new field is a new flag everywhere at once
and `configs_from_args` maps the flags back to the dataclasses, with a `Naming` that lets their errors name each
option as it was given (the flag typed, or the config file's key).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from typing import Any

from distvideo.config import EngineConfig, LoraSpec, Naming, flag_of, flags_of, option_fields
from distvideo.config_files import ConfigFile, read_config_file
from distvideo.errors import ConfigError
from distvideo.request import CACHE_METHODS, SCHEDULERS, GenerationRequest

# GenerationRequest fields offered on the command line, with their help (their flags: config.flags_of)
REQUEST_FLAGS: dict[str, dict[str, Any]] = {
    "prompt": {"help": "what the video shows"},
    "negative_prompt": {"help": "what to steer away from (default: empty)"},
    "image": {"help": "first frame of an image-to-video model (an image file)", "parse": "path", "metavar": "PATH"},
    "num_frames": {"help": "frames (for Wan: of the form 4k+1)"},
    "height": {"help": "pixels, a multiple of the model's spatial stride"},
    "width": {"help": "pixels, a multiple of the model's spatial stride"},
    "num_inference_steps": {"help": "denoising steps"},
    "guidance_scale": {"help": "CFG scale (<= 1 turns it off)"},
    "guidance_scale_2": {"help": "CFG scale of the low-noise expert (Wan2.2 A14B; default: the model's)"},
    "boundary_ratio": {"help": "switch to the low-noise expert below this fraction of the timesteps (Wan2.2 A14B)"},
    "seed": {"help": "noise seed (default 0)"},
    "fps": {"help": "frames per second of the saved video (default: the model's, 16 for Wan2.1)"},
    "output_path": {"help": "a .mp4 file, or a folder (default: outputs/)"},
    "request_timeout": {"help": "seconds; the request stops at the next denoising step after it", "parse": "seconds"},
    # step caching (docs/caching.md)
    "cache": {"help": "step caching: none (default), first-block, mag or taylorseer", "choices": CACHE_METHODS},
    "cache_threshold": {"help": "skip a step while the cache's change metric stays under this (default: per method)"},
    "cache_warmup_steps": {"help": "steps always computed first (default: 10%% first-block and taylorseer, 20%% mag)"},
    "cache_max_skip": {
        "help": "at most this many consecutive skipped steps (default: 3 for mag, 4 for taylorseer, no limit)"
    },
    # the noise schedule (docs/performance.md, "Few-step models")
    "scheduler": {"help": "default (the checkpoint's), unipc, euler or dpm", "choices": SCHEDULERS},
    "flow_shift": {"help": "the flow-matching shift (default: the checkpoint's)"},
    "timesteps": {
        "help": "one timestep per step, decreasing, e.g. 1000,750,500,250",
        "parse": "numbers",
        "metavar": "T,T,...",
    },
    "sigmas": {
        "help": "one sigma per step, decreasing, at most 1 (or --timesteps)",
        "parse": "numbers",
        "metavar": "S,S,...",
    },
}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


def _numbers(text: str) -> list[float]:
    """A comma-separated list of numbers: 1000,750,500,250 (an integer stays one)."""

    def number(part: str) -> float:
        try:
            return int(part)
        except ValueError:
            return float(part)

    try:
        return [number(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, e.g. 1000,750,500; got {text!r}"
        ) from None


def _lora(text: str) -> LoraSpec:
    try:
        return LoraSpec.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _base_type(hint: Any) -> Any:
    """int for `int | None`, bool for `bool | None`, ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    return args[0]


#: the namespace attribute where `_StoreTyped` notes which flag of an option with several was typed
TYPED_FLAGS = "_typed_flags"


class _StoreTyped(argparse.Action):
    """Stores the value, and which of the option's flags was typed (`--num-inference-steps` or `--steps`), so that
    its errors name that one."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, TYPED_FLAGS, {**getattr(namespace, TYPED_FLAGS, {}), self.dest: option_string})


def _add_field(parser: argparse.ArgumentParser, f: dataclasses.Field[Any], hint: Any, meta: dict[str, Any]) -> None:
    flags = flags_of(f.name)
    base = _base_type(hint)
    kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": meta.get("help")}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif meta.get("parse") == "lora":
        kwargs.update(action="append", type=_lora, metavar=meta.get("metavar"))
    else:
        kwargs["type"] = {"seconds": _seconds, "path": str, "numbers": _numbers}.get(meta.get("parse", ""), base)
        if len(flags) > 1:
            kwargs["action"] = _StoreTyped
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
            if f.name == "log_level":
                kwargs["type"] = str.upper
    parser.add_argument(*flags, **kwargs)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, plus --config (a YAML or JSON file the flags override)."""
    hints = typing.get_type_hints(EngineConfig)
    for f in option_fields(EngineConfig):
        _add_field(parser, f, hints[f.name], dict(f.metadata))
    parser.add_argument("--config", help="YAML or JSON file with 'engine' and 'request' sections; flags override it")


def add_request_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """The GenerationRequest fields of REQUEST_FLAGS; `defaults` changes a help text's default where a subcommand
    has its own (the bench's prompt)."""
    hints = typing.get_type_hints(GenerationRequest)
    fields = {f.name: f for f in dataclasses.fields(GenerationRequest)}
    for name, meta in REQUEST_FLAGS.items():
        _add_field(parser, fields[name], hints[name], meta)
    if defaults:
        parser.set_defaults(**defaults)


def cli_naming(args: argparse.Namespace, file_labels: dict[str, str] | None = None) -> Naming:
    """How the command line named its options: by their flags, but an option only the config file gives by its key
    there (`--config c.yaml: request.steps`), and one given by another of its flags by the flag typed."""
    given = {name: label for name, label in (file_labels or {}).items() if getattr(args, name, None) is None}
    typed = getattr(args, TYPED_FLAGS, {})
    given.update({name: flag for name, flag in typed.items() if flag and flag != flag_of(name)})
    return Naming("flag", given)


def _engine_config(args: argparse.Namespace) -> tuple[EngineConfig, ConfigFile | None]:
    """The EngineConfig from --config's 'engine' section and the engine flags (validated), and the file as read."""
    file = read_config_file(args.config) if getattr(args, "config", None) else None
    engine = dict(file.values["engine"]) if file else {}
    for f in option_fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            engine[f.name] = value
    engine_config = EngineConfig(**engine, naming=cli_naming(args, file.labels("engine") if file else None))
    engine_config.validate()
    return engine_config, file


def engine_config_from_args(args: argparse.Namespace) -> tuple[EngineConfig, dict[str, Any]]:
    """The EngineConfig from --config's 'engine' section and the engine flags (validated), and the file's 'request'
    section as it was read (checked values by option name)."""
    engine_config, file = _engine_config(args)
    return engine_config, dict(file.values["request"]) if file else {}


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, GenerationRequest]:
    """Config file first, then every flag that was given on the command line; both validated (no model needed)."""
    engine_config, file = _engine_config(args)
    request = dict(file.values["request"]) if file else {}
    for name in REQUEST_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            request[name] = value
    if not request.get("prompt"):
        raise ConfigError(
            "--prompt: required (or 'request.prompt' in --config); e.g. --prompt 'a cat surfing'", param="prompt"
        )
    gen_request = GenerationRequest(**request, naming=cli_naming(args, file.labels("request") if file else None))
    gen_request.validate()
    return engine_config, gen_request
