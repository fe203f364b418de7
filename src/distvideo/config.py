"""Typed engine configuration and generation request, and strict parsing of config files.

Bad input anywhere (flags, files, API arguments) raises :class:`ConfigError`, which the CLI maps
to exit code 2; its message names the parameter, the value seen and what would work.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distvideo.errors import ConfigError

EXECUTORS = ("auto", "inline", "mp", "external")
DTYPES = ("float32", "bfloat16", "float16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
OFFLOAD_MODES = ("none", "text", "model")  # what waits in host memory until its stage (pipelines/offload.py)

# Sane upper bounds of a request, checked before any work (what a model can take at all is checked against its
# memory estimate when the request is resolved: models/memory.py).
MAX_STEPS = 1000
MAX_PROMPT_CHARS = 20_000  # the text encoder keeps max_sequence_length tokens; the rest is cut anyway
MAX_SEQUENCE_LENGTH = 1024  # tokens; Wan's text encoders were trained with 512
MAX_FPS = 240
MAX_SIDE = 8192  # pixels per side
MAX_FRAMES = 4097


def _option(help: str, default: Any = None, **cli: Any) -> Any:
    """A config field with what its command-line flag needs (distvideo.cli.arguments builds the flags from these)."""
    return field(default=default, metadata={"help": help, **cli})


LORA_TARGETS = ("transformer", "transformer_2")


@dataclass
class LoraSpec:
    path: str
    strength: float = 1.0
    target: str = "transformer"  # the transformer it changes; "transformer_2": Wan2.2 A14B's low-noise expert

    @classmethod
    def parse(cls, text: str, given: str = "--lora") -> LoraSpec:
        """`[TARGET=]PATH[:STRENGTH]`; a trailing `:number` is the strength (paths may contain ':'), a leading
        `transformer_2=` (or `transformer=`) the transformer the adapter changes. `given` names where it came from."""
        target = "transformer"
        for name in LORA_TARGETS:
            if text.startswith(f"{name}="):
                target, text = name, text[len(name) + 1 :]
        path, sep, tail = text.rpartition(":")
        if sep and path:
            try:
                return cls(path=path, strength=float(tail), target=target)
            except ValueError:
                pass
        if not text:
            raise ConfigError(
                f"{given}: empty value; expected [transformer_2=]PATH[:STRENGTH], e.g. style.safetensors:0.8"
            )
        return cls(path=text, strength=1.0, target=target)


@dataclass
class EngineConfig:
    """How the engine runs. Fields left None take their default when the engine is resolved (`with_defaults`):
    the environment's (distvideo.envs) for the switches, the launcher's or the machine's for the rest."""

    model: str | None = _option(
        "diffusers-format checkpoint folder, or a Hugging Face repo id resolved through the hub cache (default: "
        "DISTVIDEO_MODEL, else the embedded demo model)"
    )
    num_gpus: int | None = _option("number of ranks (default 1, or the launcher's world size)")
    executor: str = _option("how ranks exist", "auto", choices=EXECUTORS)
    sp_size: int | None = _option("sequence-parallel degree (default: automatic)")
    replicas: int | None = _option(
        "data-parallel replicas for batch jobs: world = replicas x cfg x sp (default 1, or derived from fixed cfg/sp)"
    )
    cfg_parallel: bool | None = _option("run the two guidance branches on two halves of the ranks (default: auto)")
    dist_timeout: float | None = _option(
        "seconds a collective may wait for a peer (default 600, DISTVIDEO_DIST_TIMEOUT)", parse="seconds"
    )
    device: str | None = _option("e.g. cpu, cuda, cuda:1 (default: automatic)")
    dtype: str | None = _option("transformer and text-encoder dtype (default: bfloat16 on GPU)", choices=DTYPES)
    lora: list[LoraSpec] = field(
        default_factory=list,
        metadata={
            "help": "LoRA adapter PATH[:STRENGTH]; repeat to stack; transformer_2=PATH[:S] for Wan2.2 A14B's low-noise "
            "expert",
            "parse": "lora",
            "metavar": "[T=]PATH[:S]",
        },
    )
    lora_cache_mb: int | None = _option(
        "MiB of cached LoRA adapters per rank; the least recently used inactive ones go first (default 1024)"
    )
    allow_pickle_weights: bool | None = _option(
        "load .bin/.pt/.ckpt weights (a pickle can run code; default: only .safetensors)"
    )
    compact_text_padding: bool | None = _option(
        "cross-attend to the text padding as one weighted key (exact; default on, DISTVIDEO_COMPACT_TEXT_PADDING)"
    )
    cpu_kernels: bool | None = _option("oneDNN 3D convolutions and fast RMS norms on CPU (default on)")
    compile: bool | None = _option(
        "regional torch.compile of the transformer blocks: compiles at each new shape, faster steps after "
        "(default off, DISTVIDEO_COMPILE)"
    )
    offload: str | None = _option(
        "text encoder (text), also image encoder and VAE (model): in host memory until their stage (DISTVIDEO_OFFLOAD)",
        choices=OFFLOAD_MODES,
    )
    offload_experts: bool | None = _option("Wan2.2 A14B: the inactive expert waits in host memory (default: on CUDA)")
    progress: bool | None = _option("show the denoising progress bar on the output rank (default on)")
    log_level: str | None = _option("log level of distvideo's logger (default INFO)", choices=LOG_LEVELS)

    def with_defaults(self) -> EngineConfig:
        """A copy where the switches left None take the environment's defaults (the one place they are read)."""
        from distvideo import envs

        return dataclasses.replace(
            self,
            compact_text_padding=_default(self.compact_text_padding, envs.get("DISTVIDEO_COMPACT_TEXT_PADDING")),
            cpu_kernels=_default(self.cpu_kernels, envs.get("DISTVIDEO_CPU_KERNELS")),
            compile=_default(self.compile, envs.get("DISTVIDEO_COMPILE")),
            offload=self.offload or envs.get("DISTVIDEO_OFFLOAD"),
            progress=_default(self.progress, not envs.get("DISTVIDEO_NO_PROGRESS")),
            lora_cache_mb=self.lora_cache_mb if self.lora_cache_mb is not None else envs.get("DISTVIDEO_LORA_CACHE_MB"),
            log_level=(self.log_level or envs.get("DISTVIDEO_LOG_LEVEL")).upper(),
            dist_timeout=float(envs.get("DISTVIDEO_DIST_TIMEOUT") if self.dist_timeout is None else self.dist_timeout),
        )

    def validate(self) -> None:
        for f in dataclasses.fields(self):  # executor, dtype, offload, log_level (in any case)
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            seen = str(value).upper() if f.name == "log_level" else value
            if choices and value is not None and seen not in choices:
                raise ConfigError(f"{f.name}={value!r} is not supported; choose one of {', '.join(choices)}")
        if self.num_gpus is not None and self.num_gpus < 1:
            raise ConfigError(f"num_gpus={self.num_gpus} must be >= 1 (the number of ranks)")
        if self.lora_cache_mb is not None and (
            isinstance(self.lora_cache_mb, bool) or not isinstance(self.lora_cache_mb, int) or self.lora_cache_mb < 0
        ):
            raise ConfigError(f"lora_cache_mb={self.lora_cache_mb!r} must be a whole number of MiB, 0 or more")
        if self.sp_size is not None and self.sp_size < 1:
            raise ConfigError(f"sp_size={self.sp_size} must be >= 1")
        if self.replicas is not None and self.replicas < 1:
            raise ConfigError(f"replicas={self.replicas} must be >= 1")
        if self.dist_timeout is not None and not (self.dist_timeout > 0 and math.isfinite(self.dist_timeout)):
            raise ConfigError(f"dist_timeout={self.dist_timeout} must be a positive, finite number of seconds")
        for spec in self.lora:
            if not 0.0 <= abs(spec.strength) < 1e6:
                raise ConfigError(f"lora strength {spec.strength} for {spec.path} is not a finite number")
            if spec.target not in LORA_TARGETS:
                raise ConfigError(
                    f"lora target {spec.target!r} for {spec.path}: choose one of {', '.join(LORA_TARGETS)}"
                )


@dataclass
class GenerationRequest:
    """One text- or image-to-video request. None means "the model's default" (see models.registry).

    `image` (image-to-video models): a file path, a PIL image or a uint8 array (H, W, 3); the model's request
    resolution reads it into a uint8 RGB array. `guidance_scale_2` and `boundary_ratio` apply to two-expert models
    (Wan2.2 A14B): the low-noise expert's guidance scale, and the fraction of the training timesteps above which the
    high-noise expert runs."""

    prompt: str = ""
    negative_prompt: str | None = None
    image: Any = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    boundary_ratio: float | None = None
    seed: int = 0
    fps: int | None = None
    output_path: str | None = None
    save_video: bool = True
    return_frames: bool = True
    max_sequence_length: int = 512
    request_timeout: float | None = None  # seconds; the request stops at the next denoising step after it

    def validate(self) -> None:
        """Checks that need no model; model-dependent checks live in the model's spec."""
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ConfigError("prompt: must be a non-empty text, e.g. --prompt 'a cat surfing a wave'")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise ConfigError(f"negative_prompt: must be a text, got {type(self.negative_prompt).__name__}")
        for name in ("prompt", "negative_prompt"):
            text = getattr(self, name)
            if text is not None and len(text) > MAX_PROMPT_CHARS:
                raise ConfigError(
                    f"{name}: {len(text)} characters; at most {MAX_PROMPT_CHARS} (the text encoder reads only the "
                    f"first max_sequence_length={self.max_sequence_length} tokens)"
                )
        # the model's VAE sets which frame counts it takes (4k+1 for Wan)
        _check_int("num_frames", self.num_frames, minimum=1, maximum=MAX_FRAMES)
        _check_int("height", self.height, minimum=1, maximum=MAX_SIDE)
        _check_int("width", self.width, minimum=1, maximum=MAX_SIDE)
        _check_int("num_inference_steps", self.num_inference_steps, minimum=1, maximum=MAX_STEPS, flag="--steps")
        for name in ("guidance_scale", "guidance_scale_2"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name}: expected a number, got {value!r}")
            if not (0.0 <= float(value) < 1e4):
                raise ConfigError(f"{name}={value} must be >= 0 (1 or less turns classifier-free guidance off)")
        if self.boundary_ratio is not None:
            ratio = self.boundary_ratio
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
                raise ConfigError(
                    f"boundary_ratio={ratio!r} must be a number from 0 to 1 (the fraction of the training timesteps "
                    "above which the high-noise expert runs; Wan2.2 T2V-A14B uses 0.875)"
                )
        if self.image is not None:
            from distvideo.media import check_image_type

            check_image_type(self.image)
        for name in ("seed", "max_sequence_length"):
            if getattr(self, name) is None:
                raise ConfigError(f"{name}: expected an integer, got None")
        _check_int("seed", self.seed, minimum=0)
        if self.seed >= 2**63:
            raise ConfigError(f"seed={self.seed} must be below 2**63")
        _check_int("fps", self.fps, minimum=1, maximum=MAX_FPS)
        _check_int("max_sequence_length", self.max_sequence_length, minimum=1, maximum=MAX_SEQUENCE_LENGTH)
        if self.request_timeout is not None and (
            isinstance(self.request_timeout, bool)
            or not isinstance(self.request_timeout, (int, float))
            or not (self.request_timeout > 0 and math.isfinite(self.request_timeout))
        ):
            raise ConfigError(
                f"request_timeout={self.request_timeout!r} must be a positive, finite number of seconds (or unset)"
            )
        if self.output_path is not None:
            if not isinstance(self.output_path, str):
                raise ConfigError(f"output_path: expected a path, got {self.output_path!r}")
            problem = path_problem(self.output_path)
            if problem:
                raise ConfigError(f"output_path {self.output_path!r}: {problem}")

    def digest_fields(self) -> dict[str, Any]:
        """The fields every rank must agree on (all of them: the output path only matters on rank 0,
        but a difference there is still a sign of a divergent script). The image is compared by its content (a file
        by its bytes, so each node may hold its own copy), never by its path or object."""
        from distvideo.media import image_fingerprint

        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["image"] = image_fingerprint(self.image)
        return fields


def _default(value: bool | None, default: Any) -> bool:
    return bool(default) if value is None else value


def _check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None, flag: str | None = None) -> None:
    if value is None:
        return
    label = name if flag is None else f"{name} ({flag})"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{label}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{label}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{label}={value} must be <= {maximum}")


NAME_MAX = 255  # bytes of one path component on Linux file systems
PATH_MAX = 4096


def path_problem(path: str) -> str | None:
    """Why `path` cannot be a file name at all (NUL byte, over-long component or path), or None."""
    if "\x00" in path:
        return "contains a NUL byte"
    if len(os.fsencode(path)) >= PATH_MAX:
        return f"is {len(os.fsencode(path))} bytes long; paths are limited to {PATH_MAX - 1}"
    for part in Path(path).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            return f"has a name of {len(os.fsencode(part))} bytes ({part[:20]}...); names are limited to {NAME_MAX}"
    return None


# --- config files -------------------------------------------------------------------------------

_SECTIONS: dict[str, type] = {"engine": EngineConfig, "request": GenerationRequest}


def load_config_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """Parse a YAML or JSON config file into {"engine": {...}, "request": {...}} of checked values.

    Strict: an unknown key is an error naming its dotted path; a value of the wrong type names the
    key, the value and the expected type.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: cannot parse: {exc}") from None
    except RecursionError:
        raise ConfigError(f"--config {path}: cannot parse: nested too deeply") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping with sections 'engine' and 'request'")
    out: dict[str, dict[str, Any]] = {"engine": {}, "request": {}}
    for section, values in data.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"--config {path}: unknown key '{section}'; top-level keys are {', '.join(sorted(_SECTIONS))}"
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"--config {path}: '{section}' must be a mapping, got {type(values).__name__}")
        out[section] = _check_section(path, section, _SECTIONS[section], values)
    return out


def _check_section(path: str | Path, section: str, cls: type, values: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    checked: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{section}.{key}"
        if key not in names:
            raise ConfigError(f"--config {path}: unknown key '{dotted}'; known keys: {', '.join(sorted(names))}")
        if section == "engine" and key == "lora":
            checked[key] = _parse_lora_list(path, dotted, value)
            continue
        if section == "request" and key == "image":  # a file path in a config file (the API also takes arrays)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"--config {path}: '{dotted}' must be a file path, got {value!r}")
            checked[key] = value
            continue
        checked[key] = _coerce(path, dotted, hints[key], value)
    return checked


def _parse_lora_list(path: str | Path, dotted: str, value: Any) -> list[LoraSpec]:
    items = value if isinstance(value, list) else [value]
    specs = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            specs.append(LoraSpec.parse(item, given=f"--config {path}: '{dotted}[{i}]'"))
        elif (
            isinstance(item, dict) and set(item) <= {"path", "strength", "target"} and isinstance(item.get("path"), str)
        ):
            strength = item.get("strength", 1.0)
            if isinstance(strength, bool) or not isinstance(strength, (int, float)):
                raise ConfigError(f"--config {path}: '{dotted}[{i}].strength' must be a number, got {strength!r}")
            target = item.get("target", "transformer")
            if target not in LORA_TARGETS:
                raise ConfigError(
                    f"--config {path}: '{dotted}[{i}].target' must be one of {LORA_TARGETS}, got {target!r}"
                )
            specs.append(LoraSpec(path=item["path"], strength=float(strength), target=target))
        else:
            raise ConfigError(
                f"--config {path}: '{dotted}[{i}]' must be 'PATH[:STRENGTH]' or {{path: ..., strength: ..., target: ...}}, "
                f"got {item!r}"
            )
    return specs


def _coerce(path: str | Path, dotted: str, hint: Any, value: Any) -> Any:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"--config {path}: '{dotted}' must not be null")
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed if k is not type(None))
    raise ConfigError(f"--config {path}: '{dotted}' must be {names}, got {value!r}")
