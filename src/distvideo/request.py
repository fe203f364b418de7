"""One generation request and the checks it takes without a model (a model's own limits are checked when the
request is resolved against it: models/registry.py, models/memory.py)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distvideo.config import Naming, option_fields
from distvideo.errors import ConfigError
from distvideo.images import check_image_type, image_fingerprint, load_image
from distvideo.paths import path_problem

# Sane upper bounds of a request, checked before any work (what a model can take at all is checked against its
# memory estimate when the request is resolved: models/memory.py).
MAX_STEPS = 1000
MAX_PROMPT_CHARS = 20_000  # the text encoder keeps max_sequence_length tokens; the rest is cut anyway
MAX_SEQUENCE_LENGTH = 1024  # tokens; Wan's text encoders were trained with 512
MAX_FPS = 240
MAX_SIDE = 8192  # pixels per side
MAX_FRAMES = 4097

# Step caching (pipelines/caching/): the methods a request may name, and the internal one `distvideo calibrate` runs
CACHE_METHODS = ("none", "first-block", "mag", "taylorseer")
CACHE_CALIBRATE = "calibrate"
# The noise schedule (docs/performance.md, "Few-step models"): "default" is the checkpoint's own scheduler; the others
# are diffusers' flow-matching schedulers with the checkpoint's settings carried over (models/schedules.py)
SCHEDULERS = ("default", "unipc", "euler", "dpm")
MAX_FLOW_SHIFT = 100.0


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
    # step caching (docs/caching.md); None: the model's default, resolved by ModelInfo.resolve_request
    cache: str | None = None
    cache_threshold: float | None = None
    cache_warmup_steps: int | None = None
    cache_max_skip: int | None = None
    # the noise schedule; None: the checkpoint's (its scheduler config, or its distvideo_defaults.json). `timesteps`
    # and `sigmas` are explicit lists before the flow shift, as diffusers' flow-matching schedulers take them
    scheduler: str | None = None
    flow_shift: float | None = None
    timesteps: list[float] | None = None
    sigmas: list[float] | None = None
    # how the fields were given (flags, a config file, keywords), so that errors name them so (config.Naming)
    naming: Naming = field(default_factory=Naming, repr=False, compare=False, kw_only=True)

    def __post_init__(self) -> None:
        self.naming = Naming.of(self.naming)  # also from its JSON form, as the serving channel sends a request

    def validate(self) -> None:
        """Checks that need no model; model-dependent checks live in the model's spec."""
        n = self.naming
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ConfigError(
                f"{n.label('prompt')}: must be a non-empty text, e.g. {n.setting('prompt', 'a cat surfing a wave')}",
                param="prompt",
            )
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise ConfigError(
                f"{n.label('negative_prompt')}: must be a text, got {type(self.negative_prompt).__name__}",
                param="negative_prompt",
            )
        for name in ("prompt", "negative_prompt"):
            text = getattr(self, name)
            if text is not None and len(text) > MAX_PROMPT_CHARS:
                raise ConfigError(
                    f"{n.label(name)}: {len(text)} characters; at most {MAX_PROMPT_CHARS} (the text encoder reads only "
                    f"the first max_sequence_length={self.max_sequence_length} tokens)",
                    param=name,
                )
        # the model's VAE sets which frame counts it takes (4k+1 for Wan)
        _check_int(n, "num_frames", self.num_frames, minimum=1, maximum=MAX_FRAMES)
        _check_int(n, "height", self.height, minimum=1, maximum=MAX_SIDE)
        _check_int(n, "width", self.width, minimum=1, maximum=MAX_SIDE)
        _check_int(n, "num_inference_steps", self.num_inference_steps, minimum=1, maximum=MAX_STEPS)
        for name in ("guidance_scale", "guidance_scale_2"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{n.label(name)}: expected a number, got {value!r}", param=name)
            if not (0.0 <= float(value) < 1e4):
                raise ConfigError(
                    f"{n.subject(name, value)} must be >= 0 (1 or less turns classifier-free guidance off)", param=name
                )
        if self.boundary_ratio is not None:
            ratio = self.boundary_ratio
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
                raise ConfigError(
                    f"{n.subject('boundary_ratio', ratio)} must be a number from 0 to 1 (the fraction of the training "
                    "timesteps above which the high-noise expert runs; Wan2.2 T2V-A14B uses 0.875)",
                    param="boundary_ratio",
                )
        if self.image is not None:
            check_image_type(self.image, n.label("image"))
        self._validate_numbers()
        check_cache_fields(self)
        check_schedule_fields(self)
        if self.output_path is not None:
            if not isinstance(self.output_path, str):
                raise ConfigError(
                    f"{n.label('output_path')}: expected a path, got {self.output_path!r}", param="output_path"
                )
            problem = path_problem(self.output_path)
            if problem:
                raise ConfigError(f"{n.subject('output_path', self.output_path)}: {problem}", param="output_path")

    def _validate_numbers(self) -> None:
        """seed, fps, max_sequence_length and request_timeout."""
        n = self.naming
        for name in ("seed", "max_sequence_length"):
            if getattr(self, name) is None:
                raise ConfigError(f"{n.label(name)}: expected an integer, got None", param=name)
        _check_int(n, "seed", self.seed, minimum=0)
        if self.seed >= 2**63:
            raise ConfigError(f"{n.subject('seed', self.seed)} must be below 2**63", param="seed")
        _check_int(n, "fps", self.fps, minimum=1, maximum=MAX_FPS)
        _check_int(n, "max_sequence_length", self.max_sequence_length, minimum=1, maximum=MAX_SEQUENCE_LENGTH)
        if self.request_timeout is not None and (
            isinstance(self.request_timeout, bool)
            or not isinstance(self.request_timeout, (int, float))
            or not (self.request_timeout > 0 and math.isfinite(self.request_timeout))
        ):
            raise ConfigError(
                f"{n.subject('request_timeout', self.request_timeout)} must be a positive, finite number of seconds "
                "(or unset)",
                param="request_timeout",
            )

    def digest_fields(self) -> dict[str, Any]:
        """The fields every rank must agree on (all of them: the output path only matters on rank 0,
        but a difference there is still a sign of a divergent script). The image is compared by its content (a file
        by its bytes, so each node may hold its own copy), never by its path or object."""
        return _digest(self)


#: the fields a model's defaults must fill (ResolvedRequest types them as set)
FILLED_BY_RESOLUTION = ("num_frames", "height", "width", "num_inference_steps", "guidance_scale", "fps")
SECOND_EXPERT = ("boundary_ratio", "guidance_scale_2")  # and, for a two-expert model, these


@dataclass(frozen=True, kw_only=True)
class ResolvedRequest:
    """A request with every default filled and every check done, made once at the edge (the CLI, the Python API, a
    batch item, an HTTP body, the bench) by `ModelInfo.resolve_request`; frozen, and trusted downstream: nothing
    after the edge checks it again. Its fields are GenerationRequest's, those the model's defaults fill typed as set.

    `image`: the conditioning image's uint8 RGB pixels once this process has read them (`read_image`), before that
    as given (a path that every rank reads itself, a PIL image or an array); the size it sets is already resolved."""

    prompt: str
    negative_prompt: str | None
    image: Any
    num_frames: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    guidance_scale_2: float | None  # two-expert models only
    boundary_ratio: float | None  # two-expert models only
    seed: int
    fps: int
    output_path: str | None
    save_video: bool
    return_frames: bool
    max_sequence_length: int
    request_timeout: float | None
    cache: str  # "none" when off
    cache_threshold: float | None
    cache_warmup_steps: int | None
    cache_max_skip: int | None
    scheduler: str | None
    flow_shift: float | None
    timesteps: list[float] | None
    sigmas: list[float] | None
    naming: Naming = field(default_factory=Naming, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "naming", Naming.of(self.naming))  # also from its JSON form (the serving channel)

    @classmethod
    def of(cls, request: GenerationRequest, *, experts: int = 1) -> ResolvedRequest:
        """The request as resolved, once its checks passed and the model's defaults filled it; a field the model
        sets no default for is refused, naming it. `experts`: 2 for a two-expert model, whose second expert's
        settings must be filled too."""
        for name in FILLED_BY_RESOLUTION + (SECOND_EXPERT if experts == 2 else ()):
            if getattr(request, name) is None:
                raise ConfigError(f"{request.naming.label(name)}: the model sets no default; give one", param=name)
        values = {f.name: getattr(request, f.name) for f in dataclasses.fields(GenerationRequest)}
        return cls(**{**values, "cache": request.cache or "none"})

    @property
    def second_expert(self) -> tuple[float, float]:
        """(boundary_ratio, guidance_scale_2) of a two-expert model's request, which its resolution fills; a
        one-expert model's request has no second expert."""
        if self.boundary_ratio is None or self.guidance_scale_2 is None:
            raise TypeError("second_expert: this request was resolved for a one-expert model")
        return self.boundary_ratio, self.guidance_scale_2

    def read_image(self) -> ResolvedRequest:
        """The request with its image's pixels read in this process (a path: from this node's disk); ConfigError
        naming the image when it cannot be read. The size the image sets was resolved with the request."""
        image = self.image
        if image is None or (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.shape[2:] == (3,)):
            return self  # no image, or its pixels read already (load_image's RGB array)
        return dataclasses.replace(self, image=load_image(image, self.naming.label("image")))

    def digest_fields(self) -> dict[str, Any]:
        """As GenerationRequest.digest_fields: what every rank must agree on, the image by its content."""
        return _digest(self)


def _digest(request: GenerationRequest | ResolvedRequest) -> dict[str, Any]:
    fields = {f.name: getattr(request, f.name) for f in option_fields(type(request))}
    fields["image"] = image_fingerprint(request.image)
    return fields


def is_guided(request: GenerationRequest | ResolvedRequest) -> bool:
    """Whether any step of a resolved request runs two branches (classifier-free guidance): a guidance scale above 1,
    the low-noise expert's (`guidance_scale_2`, Wan2.2 A14B) counted as its own. A scale of 1 or less runs the
    conditional branch alone: no unconditional text, no second forward (guidance-distilled models)."""
    return max(request.guidance_scale or 0.0, request.guidance_scale_2 or 0.0) > 1.0


def _check_int(naming: Naming, name: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{naming.label(name)}: expected an integer, got {value!r}", param=name)
    if value < minimum:
        raise ConfigError(f"{naming.subject(name, value)} must be >= {minimum}", param=name)
    if maximum is not None and value > maximum:
        raise ConfigError(f"{naming.subject(name, value)} must be <= {maximum}", param=name)


# --- step caching ---------------------------------------------------------------------------------------------------
def check_cache_fields(request: GenerationRequest) -> None:
    """The cache options' own checks (a method's ratios for the model are checked by ModelInfo.resolve_request)."""
    n, method = request.naming, request.cache
    if method is not None and (not isinstance(method, str) or method not in (*CACHE_METHODS, CACHE_CALIBRATE)):
        raise ConfigError(
            f"{n.subject('cache', method)}: unknown method; choose one of {', '.join(CACHE_METHODS)}", param="cache"
        )
    threshold = request.cache_threshold
    if threshold is not None and (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not (math.isfinite(threshold) and threshold > 0)
    ):
        raise ConfigError(
            f"{n.subject('cache_threshold', threshold)} must be a positive, finite number (e.g. 0.05)",
            param="cache_threshold",
        )
    _check_int(n, "cache_warmup_steps", request.cache_warmup_steps, minimum=0)
    _check_int(n, "cache_max_skip", request.cache_max_skip, minimum=1)


# --- the noise schedule ---------------------------------------------------------------------------------------------
def check_schedule_fields(request: GenerationRequest) -> None:
    """The schedule options' own checks: a known scheduler, a positive flow shift, at most one explicit list, strictly
    decreasing and one value per step (what the model's scheduler takes is checked by ModelInfo.resolve_request)."""
    n = request.naming
    name = request.scheduler
    if name is not None and (not isinstance(name, str) or name not in SCHEDULERS):
        raise ConfigError(
            f"{n.subject('scheduler', name)}: unknown scheduler; choose one of {', '.join(SCHEDULERS)}",
            param="scheduler",
        )
    shift = request.flow_shift
    if shift is not None and (
        isinstance(shift, bool) or not isinstance(shift, (int, float)) or not 0.0 < float(shift) <= MAX_FLOW_SHIFT
    ):
        raise ConfigError(
            f"{n.subject('flow_shift', shift)} must be a number above 0 and at most {MAX_FLOW_SHIFT:g} (Wan uses 3 "
            "at 480p and 5 at 720p; distilled models often 5 to 8)",
            param="flow_shift",
        )
    if request.timesteps is not None and request.sigmas is not None:
        raise ConfigError(
            f"{n.label('sigmas')}: give {n.label('timesteps')} or {n.label('sigmas')}, not both (timesteps are the "
            "sigmas times the scheduler's num_train_timesteps)",
            param="sigmas",
        )
    for field_name, top in (("timesteps", None), ("sigmas", 1.0)):
        values = getattr(request, field_name)
        if values is not None:
            _check_schedule_list(request, field_name, values, top)


def _check_schedule_list(request: GenerationRequest, name: str, values: Any, top: float | None) -> None:
    n = request.naming
    example = [1000, 750, 500, 250] if name == "timesteps" else [1.0, 0.75, 0.5, 0.25]
    if (
        not isinstance(values, (list, tuple))
        or not values
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in values)
    ):
        raise ConfigError(
            f"{n.label(name)}: expected a non-empty list of numbers, one per step, e.g. {n.setting(name, example)}; "
            f"got {values!r}",
            param=name,
        )
    bound = f"above 0 and at most {top:g}" if top is not None else "above 0"
    if any(v <= 0 or (top is not None and v > top) for v in values):
        raise ConfigError(f"{n.subject(name, list(values))}: every value must be {bound}", param=name)
    if any(b >= a for a, b in itertools.pairwise(values)):
        raise ConfigError(
            f"{n.subject(name, list(values))}: must be strictly decreasing (from the noisiest step down)", param=name
        )
    steps = request.num_inference_steps
    if steps is not None and len(values) != steps:
        raise ConfigError(
            f"{n.subject(name, list(values))}: {len(values)} values for {n.subject('num_inference_steps', steps)}; "
            f"give one per step (or leave {n.label('num_inference_steps')} unset: the list sets it)",
            param=name,
        )
