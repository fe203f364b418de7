"""Typed engine configuration: how the engine runs (EngineConfig, with its LoRA adapters as LoraSpec), and the names
every option answers to (ALIASES, Naming).

Bad input anywhere (flags, files, API arguments) raises :class:`ConfigError`, which the CLI maps
to exit code 2; its message names the parameter as the user gave it, the value seen and what would work. The
request is distvideo.request, config files distvideo.config_files.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distvideo.errors import ConfigError

EXECUTORS = ("auto", "inline", "mp", "external", "ray")
DTYPES = ("float32", "bfloat16", "float16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LAYOUT_MODES = ("auto", "rules")  # the cost model (parallel/autolayout.py) or the fixed rules of parallel/layout.py
SHARD_MODES = ("none", "transformer", "all")  # what FSDP2 shards over a replica's ranks (parallel/shard.py)
#: torch.device's device types (its own list): a typo in `device` is refused before torch is imported or a rank starts
DEVICE_TYPES = (
    *("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "maia", "xla", "lazy"),
    *("vulkan", "mps", "meta", "hpu", "mtia", "privateuseone"),
)
OFFLOAD_MODES = ("none", "text", "model")  # what waits in host memory until its stage (pipelines/offload.py)
QUANTIZE_MODES = ("none", "int8", "int8-weight", "fp8", "fp8-weight")  # what each one does: models/quantize.py
ATTENTION_BACKENDS = ("sdpa", "sage", "flash")  # sdpa: torch's; sage, flash: CUDA kernels where installed
QUANTIZED_SHARDS = "FSDP2 splits each parameter by rows; torchao's quantized tensors do not implement aten.split"


# -- the names of an option ------------------------------------------------------------------------------------------
# An option is one field of EngineConfig or GenerationRequest: its name is the API keyword and the config-file key,
# its flag the name with dashes (num_gpus -> --num-gpus).
#: The one alias table: option -> (its flag where it is shorter, the other keys a config file or a prompt file may
#: use for it). Such an option's flag also answers in the name's own dashed form (--num-inference-steps).
ALIASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "num_inference_steps": ("--steps", ("steps",)),
    "output_path": ("--output", ("output",)),
}


def flag_of(name: str) -> str:
    """The flag of option `name`: `--num-gpus`, `--steps`."""
    return ALIASES[name][0] if name in ALIASES else "--" + name.replace("_", "-")


def flags_of(name: str) -> tuple[str, ...]:
    """Every flag option `name` answers to, its own first: (`--steps`, `--num-inference-steps`)."""
    return tuple(dict.fromkeys((flag_of(name), "--" + name.replace("_", "-"))))


def keys_of(name: str) -> tuple[str, ...]:
    """Every key option `name` answers to in a config file or a prompt file, its own first: (`num_inference_steps`,
    `steps`)."""
    return (name, *(ALIASES[name][1] if name in ALIASES else ()))


def option_for_key(key: str, names: Iterable[str]) -> str | None:
    """The option among `names` that `key` names (the option itself or one of its aliases), else None."""
    return next((name for name in names if key in keys_of(name)), None)


def did_you_mean(key: Any, names: Iterable[str], prefix: str = "") -> str:
    """` (did you mean 'request.num_frames'?)` for the key nearest to `key` among `names` and their aliases (written
    after `prefix`), else ''."""
    close = difflib.get_close_matches(str(key), [k for name in names for k in keys_of(name)], n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


NAMING_STYLES = ("keyword", "flag", "json")


@dataclass(frozen=True)
class Naming:
    """How the user gave the options of one EngineConfig or GenerationRequest, so that its errors name each option as
    it was typed. `style`: "keyword" (the Python API, the default: `height=100000`), "flag" (the command line:
    `--height 100000`) or "json" (the fields of an HTTP body: `height=100000`; the client may be on another machine,
    so advice names no path of this one); `given`: an option's own label where it differs from the style's, e.g. a
    config file's key (`--config c.yaml: request.steps`) or a prompt-file item's (`steps`)."""

    style: str = "keyword"
    given: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.style not in NAMING_STYLES:
            raise ValueError(f"Naming style {self.style!r}: choose one of {', '.join(NAMING_STYLES)}")

    def label(self, name: str) -> str:
        """Option `name` as the user named it: `height`, `--height`, `--config c.yaml: request.height`."""
        if name in self.given:
            return self.given[name]
        return flag_of(name) if self.style == "flag" else name

    def subject(self, name: str, value: Any) -> str:
        """What an error is about: the option with the value seen, as typed (`height=100000`, `--height 100000`,
        `--config c.yaml: request.height=100000`)."""
        label = self.label(name)
        if label.startswith("--") and " " not in label:
            return f"{label} {_flag_value(value)}"
        return f"{label}={_json_value(value) if self.style == 'json' else repr(value)}"

    def setting(self, name: str, value: Any) -> str:
        """How this user gives option `name` the value `value` (for advice): `num_gpus=2`, `--num-gpus 2`,
        `"num_gpus": 2`."""
        if self.style == "flag":
            return f"{flag_of(name)} {_flag_value(value)}"
        if self.style == "json":
            return f'"{self.label(name)}": {_json_value(value)}'
        return f"{name}={value!r}"

    def with_given(self, labels: Mapping[str, str]) -> Naming:
        return Naming(self.style, {**self.given, **labels})

    @classmethod
    def of(cls, value: Naming | Mapping[str, Any] | None) -> Naming:
        """A Naming from itself or its JSON form (`dataclasses.asdict` of a request, as the serving channel sends it)."""
        if isinstance(value, Naming):
            return value
        return cls(**value) if value else cls()


def _flag_value(value: Any) -> str:  # a list as its flag takes it: 1000,750,500
    if isinstance(value, list):
        return ",".join(map(str, value))
    return shlex.quote(value) if isinstance(value, str) else str(value)


def _json_value(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def option_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The options of a config dataclass: its fields but `naming` (which says how they were given)."""
    return [f for f in dataclasses.fields(cls) if f.name != "naming"]


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
    layout: str = _option(
        "auto: with no layout option given, the cost model chooses replicas, cfg, ulysses, ring and sharding "
        "(`distvideo plan` shows why); rules: the fixed defaults (CFG parallelism on an even world, sp the rest)",
        "auto",
        choices=LAYOUT_MODES,
    )
    sp_size: int | None = _option("sequence-parallel degree (default: automatic)")
    # -- USP: sp_size = ulysses_size x ring_size (parallel/ring.py) --
    ulysses_size: int | None = _option(
        "Ulysses share of sp_size, must divide the heads (default: the largest divisor of the heads that divides sp)"
    )
    ring_size: int | None = _option("ring-attention share of sp_size (default: sp_size / ulysses_size)")
    # -- end USP --
    shard_weights: str | None = _option(
        "FSDP2 over the ranks of a replica: none, transformer (the denoising transformers' blocks, each gathered just "
        "before use), all (also the text encoders); default: none, unless the automatic layout needs it to fit",
        choices=SHARD_MODES,
    )
    replicas: int | None = _option(
        "data-parallel replicas for batch jobs: world = replicas x cfg x sp (default 1, or derived from fixed cfg/sp)"
    )
    cfg_parallel: bool | None = _option("run the two guidance branches on two halves of the ranks (default: auto)")
    dist_timeout: float | None = _option(
        "seconds a collective may wait for a peer (default 600, DISTVIDEO_DIST_TIMEOUT)", parse="seconds"
    )
    device: str | None = _option("e.g. cpu, cuda (each rank's own GPU), cuda:1 (default: automatic)")
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
        "text encoders (text), also image encoder and VAE (model): in host memory until their stage (DISTVIDEO_OFFLOAD)",
        choices=OFFLOAD_MODES,
    )
    quantize: str | None = _option(
        "8-bit weights of the denoising transformer(s): int8 (weights and activations; CPU, CUDA), int8-weight, fp8 "
        "(CUDA, compute capability 8.9+), fp8-weight (float8 storage: memory, not speed); default none",
        choices=QUANTIZE_MODES,
    )
    quantize_text_encoder: str | None = _option(
        "the same for the text encoder(s) (default none)", choices=QUANTIZE_MODES
    )
    attention: str | None = _option(
        "attention kernel: sdpa (default), sage (SageAttention) or flash (FlashAttention) on CUDA where installed",
        choices=ATTENTION_BACKENDS,
    )
    offload_experts: bool | None = _option("Wan2.2 A14B: the inactive expert waits in host memory (default: on CUDA)")
    progress: bool | None = _option("show the denoising progress bar on the output rank (default on)")
    log_level: str | None = _option("log level of distvideo's logger (default INFO)", choices=LOG_LEVELS)
    # -- the Ray executor ---------------------------------------------------------------------------------------------
    ray_address: str | None = _option(
        "executor='ray': the cluster to join, 'auto' or HOST:PORT (default: a running cluster, else a local one on "
        "127.0.0.1)"
    )
    # how the options were given, so that errors name them so (not an option: not compared, not shown)
    naming: Naming = field(default_factory=Naming, repr=False, compare=False, kw_only=True)

    def with_defaults(self) -> EngineConfig:
        """A copy where the switches left None take the environment's defaults (the one place they are read)."""
        from distvideo import envs

        return dataclasses.replace(
            self,
            shard_weights=self.shard_weights or "none",
            quantize=self.quantize or "none",
            quantize_text_encoder=self.quantize_text_encoder or "none",
            attention=self.attention or "sdpa",
            compact_text_padding=_default(self.compact_text_padding, envs.get("DISTVIDEO_COMPACT_TEXT_PADDING")),
            cpu_kernels=_default(self.cpu_kernels, envs.get("DISTVIDEO_CPU_KERNELS")),
            compile=_default(self.compile, envs.get("DISTVIDEO_COMPILE")),
            offload=self.offload or envs.get("DISTVIDEO_OFFLOAD"),
            progress=_default(self.progress, not envs.get("DISTVIDEO_NO_PROGRESS")),
            lora_cache_mb=self.lora_cache_mb if self.lora_cache_mb is not None else envs.get("DISTVIDEO_LORA_CACHE_MB"),
            log_level=(self.log_level or envs.get("DISTVIDEO_LOG_LEVEL")).upper(),
            dist_timeout=float(envs.get("DISTVIDEO_DIST_TIMEOUT") if self.dist_timeout is None else self.dist_timeout),
        )

    def _validate_sharding(self) -> None:
        """What sharded weights do not combine with yet, refused before anything loads."""
        if self.shard_weights in (None, "none"):
            return
        conflicts = [
            (bool(self.compile), "compile", "regional compilation of FSDP-wrapped blocks is not tested yet"),
            (self.offload not in (None, "none"), "offload", "offload moves whole components, a shard stays put"),
            (self.quantize not in (None, "none"), "quantize", QUANTIZED_SHARDS),
            (self.quantize_text_encoder not in (None, "none"), "quantize_text_encoder", QUANTIZED_SHARDS),
        ]
        for present, name, why in conflicts:
            if present:
                raise ConfigError(
                    f"{self.naming.subject('shard_weights', self.shard_weights)} with {self.naming.label(name)}: not "
                    f"supported together ({why})",
                    param="shard_weights",
                )

    def validate(self) -> None:
        n = self.naming
        for f in option_fields(EngineConfig):  # executor, dtype, offload, log_level (in any case)
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            seen = str(value).upper() if f.name == "log_level" else value
            if choices and value is not None and seen not in choices:
                raise ConfigError(
                    f"{n.subject(f.name, value)} is not supported; choose one of {', '.join(choices)}", param=f.name
                )
        if self.num_gpus is not None and self.num_gpus < 1:
            raise ConfigError(
                f"{n.subject('num_gpus', self.num_gpus)} must be >= 1 (the number of ranks)", param="num_gpus"
            )
        if self.lora_cache_mb is not None and (
            isinstance(self.lora_cache_mb, bool) or not isinstance(self.lora_cache_mb, int) or self.lora_cache_mb < 0
        ):
            raise ConfigError(
                f"{n.subject('lora_cache_mb', self.lora_cache_mb)} must be a whole number of MiB, 0 or more",
                param="lora_cache_mb",
            )
        for name in ("sp_size", "replicas"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{n.subject(name, value)} must be >= 1", param=name)
        self._validate_usp()
        self._validate_sharding()
        if self.dist_timeout is not None and not (self.dist_timeout > 0 and math.isfinite(self.dist_timeout)):
            raise ConfigError(
                f"{n.subject('dist_timeout', self.dist_timeout)} must be a positive, finite number of seconds",
                param="dist_timeout",
            )
        if self.ray_address is not None:
            _check_ray_address(n, self.executor, self.ray_address)
        if self.device is not None:
            _check_device(n, self.device)
        for spec in self.lora:
            if not 0.0 <= abs(spec.strength) < 1e6:
                raise ConfigError(f"lora strength {spec.strength} for {spec.path} is not a finite number", param="lora")
            if spec.target not in LORA_TARGETS:
                raise ConfigError(
                    f"lora target {spec.target!r} for {spec.path}: choose one of {', '.join(LORA_TARGETS)}",
                    param="lora",
                )

    def _validate_usp(self) -> None:
        """ulysses_size and ring_size: whole numbers >= 1 multiplying to sp_size (when all are given)."""
        n = self.naming
        for name in ("ulysses_size", "ring_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(
                    f"{n.subject(name, value)} must be a whole number >= 1 (sp_size = ulysses_size x ring_size)",
                    param=name,
                )
        u, r, sp = self.ulysses_size, self.ring_size, self.sp_size
        if u is not None and r is not None and sp is not None and u * r != sp:
            raise ConfigError(
                f"{n.subject('ulysses_size', u)} x {n.subject('ring_size', r)} = {u * r} != "
                f"{n.subject('sp_size', sp)}; give sp_size = ulysses_size x ring_size, or leave one of them unset",
                param="sp_size",
            )


def _check_device(naming: Naming, device: str) -> None:
    """device: TYPE or TYPE:INDEX with one of torch's device types (whether this host has it, the ranks tell)."""
    kind, colon, index = str(device).partition(":")
    if kind not in DEVICE_TYPES or (colon and not index.isdigit()):
        raise ConfigError(
            f"{naming.subject('device', device)} is not a device: give TYPE or TYPE:INDEX, e.g. cpu, cuda (each "
            f"rank's own GPU) or cuda:1; TYPE is one of {', '.join(DEVICE_TYPES)}",
            param="device",
        )


def _check_ray_address(naming: Naming, executor: str, address: str) -> None:
    """ray_address: 'auto' or HOST:PORT, and only with executor='ray'."""
    if executor != "ray":
        raise ConfigError(
            f"{naming.subject('ray_address', address)} is only used with {naming.setting('executor', 'ray')} "
            f"(not {naming.subject('executor', executor)})",
            param="ray_address",
        )
    host, _, port = address.rpartition(":")
    if address != "auto" and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(
            f"{naming.subject('ray_address', address)}: give 'auto' or HOST:PORT of a Ray cluster's head (e.g. "
            "10.0.0.5:6379)",
            param="ray_address",
        )


def _default(value: bool | None, default: Any) -> bool:
    return bool(default) if value is None else value
