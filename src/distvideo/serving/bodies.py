"""Reading the body of POST /v1/videos: JSON, or multipart/form-data with the same fields as text parts (lora as JSON
text) and an optional `input_reference` image; anything else is 415. Errors name the field (422)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from distvideo.serving.admission import ApiError
from distvideo.serving.http_errors import from_validation
from distvideo.serving.schemas import VideoCreate


async def read_create_body(request: Request) -> tuple[VideoCreate, UploadFile | None]:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        raw = await request.body()
        try:
            return VideoCreate.model_validate_json(raw, strict=True), None
        except ValidationError as exc:
            raise from_validation(list(exc.errors())) from None
    if kind == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=32)
        fields: dict[str, Any] = {}
        image: UploadFile | None = None
        for key, value in form.multi_items():
            if key in fields or (key == "input_reference" and image is not None):
                raise ApiError(422, f"{key}: given more than once", param=key)
            if key == "input_reference":
                if not isinstance(value, UploadFile):
                    raise ApiError(422, "input_reference: expected an image file part", param="input_reference")
                image = value
            elif isinstance(value, UploadFile):
                raise ApiError(422, f"{key}: expected a text part, got a file", param=key)
            elif value != "":  # an empty form field is a field not given (what HTML forms send)
                fields[key] = _form_value(key, value)
        try:
            return VideoCreate.model_validate(fields), image
        except ValidationError as exc:
            raise from_validation(list(exc.errors())) from None
    raise ApiError(
        415,
        f"Content-Type {kind or '(none)'!r}: send application/json or multipart/form-data",
        code="unsupported_media_type",
    )


def _form_value(key: str, value: str) -> Any:
    if key != "lora":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise ApiError(
            422, 'lora: expected JSON text such as {"name": "style", "strength": 0.8}', param="lora"
        ) from None
