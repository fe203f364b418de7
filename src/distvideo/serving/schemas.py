"""The API's bodies, in the shape of OpenAI's video API (`video` objects, lists with cursors, `{"error": {...}}`) with
the engine's own request fields as extensions. FastAPI builds the OpenAPI schema from these models."""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from distvideo.serving.store import JobRecord

Status = Literal["queued", "in_progress", "completed", "failed"]
MAX_SECONDS = 3600
_SECONDS_TEXT = r"^[0-9]{1,4}(\.[0-9]{1,6})?$"


def _seconds(value: object) -> str | float:
    """A duration as text ("5", "2.5") or a number (5, 2.5): one rule for both, 0 < seconds <= MAX_SECONDS. Text
    stays text (the job shows what was asked); whether it is a whole number of frames, admission checks."""
    if isinstance(value, str):
        if not re.fullmatch(_SECONDS_TEXT, value):
            raise PydanticCustomError("seconds", "must be a number of seconds such as 5 or 2.5, as a number or text")
        number = float(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise PydanticCustomError("seconds", "must be a number of seconds such as 5 or 2.5, as a number or text")
    if not (math.isfinite(number) and 0 < number <= MAX_SECONDS):
        raise PydanticCustomError("seconds", f"must be more than 0 and at most {MAX_SECONDS}")
    return value if isinstance(value, str) else number


# one field, one validator for both forms (a plain union would check each form apart and name its branches)
Seconds = Annotated[
    str | float,
    PlainValidator(_seconds),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SECONDS},
                {"type": "string", "pattern": _SECONDS_TEXT},
            ]
        }
    ),
]


class LoraChoice(BaseModel):
    """A LoRA adapter the server registered (`--lora-adapter NAME=PATH`), applied to this job only."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    strength: float = Field(1.0, ge=-100, le=100, allow_inf_nan=False)


class VideoCreate(BaseModel):
    """POST /v1/videos. Unset fields take the model's defaults (GET /v1/models)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1, max_length=20000, description="what the video shows")
    model: str | None = Field(None, max_length=500, description="the served model's id (GET /v1/models)")
    size: str | None = Field(
        None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$", description="WIDTHxHEIGHT in pixels", examples=["832x480"]
    )
    seconds: Seconds | None = Field(
        None,
        description=f"duration, more than 0 and at most {MAX_SECONDS}, as a number or text: num_frames = seconds x "
        "fps + 1 (give seconds or num_frames)",
    )
    num_frames: int | None = Field(None, ge=1, le=100000, description="frames (for Wan: of the form 4k+1)")
    fps: int | None = Field(
        None, ge=1, le=240, description="frames per second (default: the model's, 16 for Wan2.1, 24 for Wan2.2 TI2V-5B)"
    )
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="noise seed (default 0): same seed, same video")
    num_inference_steps: int | None = Field(None, ge=1, le=100000, description="denoising steps")
    guidance_scale: float | None = Field(None, ge=0, lt=10000, allow_inf_nan=False, description="CFG scale")
    negative_prompt: str | None = Field(None, max_length=20000)
    lora: LoraChoice | None = None
    # step caching, chosen per request (docs/caching.md); checked by the model's request resolution
    cache: str | None = Field(None, max_length=32, description="step caching: none, first-block, mag or taylorseer")
    cache_threshold: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="skip while the cache's metric stays under this"
    )
    cache_warmup_steps: int | None = Field(None, ge=0, le=100000, description="steps always computed first")
    cache_max_skip: int | None = Field(None, ge=1, le=100000, description="at most this many consecutive skips")
    # the noise schedule (docs/performance.md, "Few-step models"); checked by the model's request resolution
    scheduler: str | None = Field(None, max_length=32, description="default (the checkpoint's), unipc, euler or dpm")
    flow_shift: float | None = Field(None, gt=0, allow_inf_nan=False, description="the flow-matching shift")
    # at most 100 values over HTTP (a request body stays under the server's size limit in any encoding)
    timesteps: list[float] | None = Field(
        None, min_length=1, max_length=100, description="one timestep per step, decreasing (e.g. [1000, 750, 500])"
    )
    sigmas: list[float] | None = Field(
        None, min_length=1, max_length=100, description="one sigma per step, decreasing, at most 1 (or timesteps)"
    )


class VideoError(BaseModel):
    code: str
    message: str


class VideoEvent(BaseModel):
    """One event of GET /v1/videos/{id}/events: `queued`, `started` (on data-parallel replica `replica`), `progress`
    (after denoising step `step` of `steps`), then `completed` or `failed` (with `error`), which ends the stream."""

    type: Literal["queued", "started", "progress", "completed", "failed"]
    video_id: str
    status: Status
    progress: int = Field(ge=0, le=100)
    step: int | None = None
    steps: int | None = None
    replica: int | None = None
    error: VideoError | None = None


class LoraApplied(BaseModel):
    name: str
    strength: float


class Video(BaseModel):
    id: str
    object: Literal["video"] = "video"
    model: str
    status: Status
    progress: int = Field(ge=0, le=100, description="percent; follows the denoising steps")
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    size: str
    seconds: str
    prompt: str
    num_frames: int
    fps: int
    seed: int
    num_inference_steps: int
    guidance_scale: float
    negative_prompt: str | None = None
    lora: LoraApplied | None = None
    warnings: list[str] = Field(
        default_factory=list, description="what the request asks of the model that it cannot do well (the prompt)"
    )
    error: VideoError | None = None

    @classmethod
    def of(cls, record: JobRecord) -> Video:
        api = record.params["api"]
        error = None
        if record.status == "failed":
            error = VideoError(code=record.error_code or "failed", message=record.error_message or "")
        return cls(
            id=record.id,
            model=record.model,
            status=record.status,  # type: ignore[arg-type]
            progress=record.progress,
            created_at=record.created_at,
            completed_at=record.completed_at,
            error=error,
            **api,
        )


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "distvideo"
    family: str
    defaults: dict[str, float]
    spatial_stride: int = Field(description="width and height must be multiples of it")
    frames_per_latent: int = Field(description="num_frames must be of the form k x this + 1")
    image_input: bool = Field(description="whether the model takes an input_reference image")
    lora_adapters: list[str]
    example_prompt: str = Field(description="a prompt that fits the model (the demo model's grammar for the demo)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ReplicaHealth(BaseModel):
    """One data-parallel replica of the engine: idle, or busy with `job`; jobs ended on it; its last job error."""

    replica: int
    state: Literal["idle", "busy"]
    job: str | None = None
    jobs_done: int
    last_error: str | None = None


class Health(BaseModel):
    status: Literal["loading", "ok", "stopping", "unhealthy"]
    detail: str | None = None
    executor: str
    world_size: int
    replicas: list[ReplicaHealth] | None = None  # with --replicas 2 or more: each replica's state


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
