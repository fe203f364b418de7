"""Every error answer in one shape, OpenAI's `{"error": {"message", "type", "param", "code"}}`: for our own refusals
(ApiError), FastAPI's validation errors (422 naming the field; 400 for a body that is not JSON) and Starlette's HTTP
errors (unknown route, wrong method); and the request body size limit (413), checked before a body is read whole."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from distvideo.serving.admission import ApiError
from distvideo.serving.schemas import ErrorResponse


def error_response(error: ApiError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


# what pydantic names a union's branches by in `loc` when they are plain types (others carry '-' or '[': 'function-after[..]')
_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "set", "none", "decimal"})


def from_validation(errors: list[Any], *, prefix_to_drop: tuple[str, ...] = ("body", "query", "path")) -> ApiError:
    """One ApiError for pydantic's error list: the first error names the field (`param`: the request's own field, the
    message: the path to it inside, e.g. lora.name); a body that is not JSON is a 400."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    loc = [part for part in first.get("loc", ()) if str(part) not in prefix_to_drop]
    # pydantic puts labels of what it tried into `loc` too (a union's branches: 'str', 'constrained-str',
    # 'function-after[...]'): the path ends at the first part that is no field name or list index
    fields = [str(part) for part in loc[:1]]
    for part in loc[1:]:
        if not isinstance(part, int) and (part in _TYPE_LABELS or not part.isidentifier()):
            break
        fields.append(str(part))
    param = fields[0] if fields else None
    where = ".".join(fields) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}", code="invalid_json")
    if first.get("type") == "extra_forbidden":
        return ApiError(422, f"{where}: unknown field; see the request schema at /openapi.json", param=param)
    message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    if "input" in first and first.get("type") != "missing":
        message += f" (got {_short(first['input'])})"
    return ApiError(422, message, param=param)


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation(list(exc.errors())))

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(from_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # FastAPI has one route per method: Allow must list every route of this path
            headers["Allow"] = ", ".join(_methods_for(app, request.url.path))
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code, headers=headers))


def _methods_for(app: FastAPI, path: str) -> list[str]:
    methods: set[str] = set()
    for route in app.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(path):
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


ERROR_RESPONSE = {"model": ErrorResponse}


class _TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 (by its Content-Length, or while it streams in)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(send)
                return
        seen, started = 0, False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        error = ApiError(
            413, f"the request body is larger than this server's limit of {self.limit} bytes", code="too_large"
        )
        body = json.dumps({"error": {"message": error.message, "type": error.kind, "param": None, "code": error.code}})
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})
