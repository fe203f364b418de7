"""Admission: a POST body becomes a ResolvedRequest, or an error naming the field, before anything is
queued. The model's own rules come from `ModelInfo.resolve_request` (the same check `distvideo generate` runs)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distvideo.config import Naming
from distvideo.errors import ConfigError
from distvideo.models.embedded import prompt_warning
from distvideo.models.registry import ModelInfo
from distvideo.models.schedules import SCHEDULE_KEYS  # chosen per request too
from distvideo.request import GenerationRequest, ResolvedRequest
from distvideo.serving.options import ServeLimits
from distvideo.serving.schemas import VideoCreate

#: request fields a config file's `request` section may preset for every job (the rest belong to each request)
PRESETTABLE = ("negative_prompt", "num_frames", "num_inference_steps", "guidance_scale", "seed", "fps")
CACHE_FIELDS = ("cache", "cache_threshold", "cache_warmup_steps", "cache_max_skip")  # chosen per request
_FIELD = re.compile(r"^([a-z_]+)\b")
#: a request's options as the body names them (its errors are shown to a client, perhaps on another machine)
BODY_NAMING = Naming("json", {"image": "input_reference"})


class ApiError(Exception):
    """An answer other than success: HTTP status, a message for the person, the field it is about."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str = "invalid_value",
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}


@dataclass(frozen=True)
class Admission:
    """What admitting a request needs to know; fixed for the life of the server."""

    model: ModelInfo
    model_id: str
    limits: ServeLimits
    output: Path
    adapters: frozenset[str] = frozenset()
    presets: dict[str, Any] = field(default_factory=dict)

    @property
    def takes_image(self) -> bool:
        """Whether the served family takes a conditioning image (`input_reference`)."""
        return self.model.family.takes_image

    def admit(
        self, body: VideoCreate, job_id: str, image_path: str | None = None
    ) -> tuple[dict[str, Any], ResolvedRequest]:
        """(the job's fields as the API shows them, the ResolvedRequest). Raises ApiError(422)."""
        if body.model is not None and body.model != self.model_id:
            raise ApiError(
                422, f"model={body.model!r} is not served here; this server runs {self.model_id!r}", param="model"
            )
        if image_path is not None and not self.takes_image:
            raise ApiError(
                422,
                f"input_reference: {self.model_id} ({self.model.class_name}) is a text-to-video model and takes no "
                "image; send the request without input_reference",
                param="input_reference",
            )
        if body.lora is not None and body.lora.name not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none (start the server with --lora-adapter NAME=PATH)"
            raise ApiError(422, f"lora.name={body.lora.name!r} is not registered; registered: {known}", param="lora")
        request = self._request(body, job_id, image_path)
        try:
            if body.seconds is not None:  # a duration: frames at the request's rate, which the model's defaults decide
                fps = request.fps if request.fps is not None else int(self.model.defaults["fps"])
                request = dataclasses.replace(request, num_frames=self._frames_of(body, fps))
            resolved = self.model.resolve_request(request)  # reads the image: one that is not is refused here
            if image_path is not None:  # the engine reads it again on every rank, from the path
                resolved = dataclasses.replace(resolved, image=image_path)
        except ConfigError as exc:
            raise self.refusal(exc, body, image_path) from None
        self._check_limits(resolved, body)
        api = {
            "prompt": resolved.prompt,
            "size": f"{resolved.width}x{resolved.height}",
            "seconds": f"{(resolved.num_frames - 1) / resolved.fps:g}",
            "num_frames": resolved.num_frames,
            "fps": resolved.fps,
            "seed": resolved.seed,
            "num_inference_steps": resolved.num_inference_steps,
            "guidance_scale": resolved.guidance_scale,
            "negative_prompt": resolved.negative_prompt,
            "lora": None if body.lora is None else {"name": body.lora.name, "strength": body.lora.strength},
            "warnings": [w for w in [prompt_warning(self.model.path, resolved.prompt)] if w],
        }
        return api, resolved

    def _request(self, body: VideoCreate, job_id: str, image_path: str | None) -> GenerationRequest:
        values: dict[str, Any] = {k: v for k, v in self.presets.items() if k in PRESETTABLE and v is not None}
        for name in ("negative_prompt", "num_frames", "num_inference_steps", "guidance_scale", "seed", "fps"):
            if getattr(body, name) is not None:
                values[name] = getattr(body, name)
        for name in (*CACHE_FIELDS, *SCHEDULE_KEYS):
            if getattr(body, name) is not None:
                values[name] = getattr(body, name)
        if body.size is not None:
            width, height = (int(v) for v in body.size.split("x"))
            values.update(width=width, height=height)
        if image_path is not None:
            values["image"] = image_path
        return GenerationRequest(
            prompt=body.prompt,
            output_path=str(self.output / f"{job_id}.mp4"),  # the server names the file, never the request
            save_video=True,
            return_frames=False,
            naming=BODY_NAMING,
            **values,
        )

    @staticmethod
    def _frames_of(body: VideoCreate, fps: int) -> int:
        seconds = float(body.seconds)  # type: ignore[arg-type]
        exact = seconds * fps + 1
        frames = round(exact)
        if abs(exact - frames) > 1e-6 or frames < 1:
            raise ApiError(
                422,
                f"seconds={body.seconds} at fps={fps} is {exact - 1:g} frame intervals, not a whole number; "
                f"num_frames = seconds x fps + 1 (e.g. seconds={max(1, round(seconds))} gives "
                f"{max(1, round(seconds)) * fps + 1} frames), or give num_frames",
                param="seconds",
            )
        if body.num_frames is not None and body.num_frames != frames:
            raise ApiError(
                422,
                f"seconds={body.seconds} at fps={fps} means {frames} frames but num_frames={body.num_frames}; give one",
                param="num_frames",
            )
        return frames

    def refusal(self, exc: ConfigError, body: VideoCreate | None = None, image_path: str | None = None) -> ApiError:
        """The 422 for input the engine refused: `param` the body's field, and a message with no path of this machine
        (the client may be anywhere): the upload is "the uploaded file", the model folder the model's id, the output
        folder "(output)"."""
        text = str(exc)
        swaps = [(str(self.model.path), self.model_id), (str(self.output), "(output)")]
        if image_path:
            swaps[:0] = [(repr(image_path), "the uploaded file"), (image_path, "the uploaded file")]
        for path, name in swaps:
            text = text.replace(path, name)
        return ApiError(422, text, param=self._param_of(exc, body))

    @staticmethod
    def _param_of(exc: ConfigError, body: VideoCreate | None) -> str | None:
        """The body's field an error is about: the error's option (`exc.param`, else the name its message starts
        with) as the API names it (size for height and width, input_reference for the image, seconds for the frames
        a duration gave); None when it is about no field of the body."""
        match = _FIELD.match(str(exc))
        name = exc.param or (match.group(1) if match else None)
        if name in ("height", "width"):
            return "size"
        if name == "image":
            return "input_reference"
        if name == "num_frames" and body is not None and body.seconds is not None and body.num_frames is None:
            return "seconds"
        return name if name in VideoCreate.model_fields else None

    def _check_limits(self, request: ResolvedRequest, body: VideoCreate) -> None:
        limits = self.limits
        assert request.num_frames and request.width and request.height and request.num_inference_steps
        if request.num_frames > limits.max_frames:
            param = "seconds" if body.seconds is not None and body.num_frames is None else "num_frames"
            raise ApiError(
                422,
                f"num_frames={request.num_frames} is more than this server's --max-frames={limits.max_frames}",
                param=param,
            )
        if request.width * request.height > limits.max_pixels:
            raise ApiError(
                422,
                f"size={request.width}x{request.height} has {request.width * request.height} pixels per frame, more "
                f"than this server's --max-pixels={limits.max_pixels}",
                param="size",
            )
        if request.num_inference_steps > limits.max_steps:
            raise ApiError(
                422,
                f"num_inference_steps={request.num_inference_steps} is more than this server's "
                f"--max-steps={limits.max_steps}",
                param="num_inference_steps",
            )
        for name, text in (("prompt", request.prompt), ("negative_prompt", body.negative_prompt)):  # as sent
            if text is not None and len(text) > limits.max_prompt_chars:
                raise ApiError(422, f"{name}: longer than {limits.max_prompt_chars} characters", param=name)
