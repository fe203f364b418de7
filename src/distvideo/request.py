"""One generation request and the checks it takes without a model (a model's own limits are checked when the
request is resolved against it: models/registry.py, models/memory.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from distvideo.config import Naming, option_fields
from distvideo.errors import ConfigError
from distvideo.images import check_image_type, image_fingerprint
from distvideo.paths import path_problem

# Sane upper bounds of a request, checked before any work (what a model can take at all is checked against its
# memory estimate when the request is resolved: models/memory.py).
MAX_STEPS = 1000
MAX_PROMPT_CHARS = 20_000  # the text encoder keeps max_sequence_length tokens; the rest is cut anyway
MAX_SEQUENCE_LENGTH = 1024  # tokens; Wan's text encoders were trained with 512
MAX_FPS = 240
MAX_SIDE = 8192  # pixels per side
MAX_FRAMES = 4097

# Step caching (pipelines/caching.py): the methods a request may name, and the internal one `distvideo calibrate` runs
CACHE_METHODS = ("none", "first-block", "mag")
CACHE_CALIBRATE = "calibrate"


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
        fields = {f.name: getattr(self, f.name) for f in option_fields(GenerationRequest)}
        fields["image"] = image_fingerprint(self.image)
        return fields


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
