"""The HTTP API (FastAPI): handlers validate, enqueue and read the job store; they never call the engine, which the
engine loop owns (runner.py). Shape: OpenAI's video API (`/v1/videos`), with the engine's fields as extensions."""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse

from distvideo.errors import ConfigError
from distvideo.models.embedded import example_prompt
from distvideo.serving import metrics
from distvideo.serving.admission import Admission, ApiError
from distvideo.serving.board import ReplicaBoard
from distvideo.serving.bodies import read_create_body
from distvideo.serving.events import JobEvents
from distvideo.serving.http_errors import ERROR_RESPONSE, BodyLimit, install_error_handlers
from distvideo.serving.jobs import OK, QueuedJob, QueueFull, Service, ServiceClosed
from distvideo.serving.schemas import (
    Health,
    ModelCard,
    ModelList,
    ReplicaHealth,
    Video,
    VideoCreate,
    VideoDeleted,
    VideoEvent,
    VideoList,
)
from distvideo.serving.store import COMPLETED, IN_PROGRESS, QUEUED, JobRecord, JobStore


@dataclass(frozen=True)
class AppContext:
    service: Service
    store: JobStore
    admission: Admission
    cancel_running: Callable[[str], bool]  # the engine loop's cancel(job_id)
    executor: str
    world_size: int
    events: JobEvents
    api_keys: tuple[str, ...] = ()  # none: no key required
    max_body_bytes: int = 16 * 1024 * 1024
    board: ReplicaBoard | None = None  # what each data-parallel replica does (none before the engine loop exists)


def _create_body_schema() -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/VideoCreate"}
    form = {"$ref": "#/components/schemas/VideoCreateForm"}
    return {"required": True, "content": {"application/json": {"schema": ref}, "multipart/form-data": {"schema": form}}}


def _form_schema() -> dict[str, Any]:
    """multipart/form-data: the same fields as text parts (lora as JSON text), plus the input_reference image."""
    properties = dict(VideoCreate.model_json_schema(ref_template="#/components/schemas/{model}")["properties"])
    properties["lora"] = {"type": "string", "description": 'JSON text, e.g. {"name": "style", "strength": 0.8}'}
    properties["input_reference"] = {"type": "string", "format": "binary", "description": "image for image-to-video"}
    return {"type": "object", "properties": properties, "required": ["prompt"], "additionalProperties": False}


def client_of(ctx: AppContext, token: str) -> str | None:
    """Which client a bearer token is ("key N", N counting from 1 in --api-key, --api-keys-file order); None if it
    is no key. Every key is compared, in constant time each."""
    found = None
    for number, key in enumerate(ctx.api_keys, 1):
        if hmac.compare_digest(token.encode(), key.encode()):
            found = f"key {number}"
    return found


def _client(ctx: AppContext, request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return (client_of(ctx, token.strip()) if scheme.lower() == "bearer" else None) or ""


@dataclass(frozen=True)
class Guard:
    """The API key check of the guarded routes, and the 401 it adds to their documented answers."""

    dependencies: list[Any]
    errors: dict[int | str, dict[str, Any]]
    errors_as_json: dict[int | str, dict[str, Any]]


def create_app(ctx: AppContext) -> FastAPI:
    app = FastAPI(
        title="distvideo",
        version="1",
        summary="Video generation with diffusion transformers on one or many ranks (OpenAI video API shape)",
    )
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=ctx.max_body_bytes)
    bearer = HTTPBearer(auto_error=False)

    # async, as every dependency here: a plain `def` would run in anyio's thread pool, a thread hand-off per request
    async def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not ctx.api_keys:
            return
        if credentials is None or client_of(ctx, credentials.credentials) is None:
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                kind="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )

    error_json = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    guard = Guard(
        dependencies=[Depends(authorized)] if ctx.api_keys else [],
        errors={401: ERROR_RESPONSE} if ctx.api_keys else {},
        errors_as_json={401: {"content": error_json}} if ctx.api_keys else {},  # for routes that answer other types
    )
    _add_service_routes(app, ctx, guard)
    _add_create_route(app, ctx, guard)
    _add_read_routes(app, ctx, guard)
    _add_events_route(app, ctx, guard)
    _add_delete_route(app, ctx, guard)

    def _custom_openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            body = VideoCreate.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))  # the body is read by hand (JSON or multipart): add its models
            components["VideoCreate"] = body
            components["VideoCreateForm"] = _form_schema()
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = _custom_openapi  # type: ignore[method-assign]
    return app


def _replica_health(board: ReplicaBoard | None) -> list[ReplicaHealth] | None:
    """Each replica's state, on a server with several (one replica: the service's own status says it all)."""
    if board is None or board.replicas < 2:
        return None
    return [
        ReplicaHealth(replica=r.replica, state=r.state, job=r.job, jobs_done=r.jobs_done, last_error=r.last_error)
        for r in board.snapshot()
    ]


def _add_service_routes(app: FastAPI, ctx: AppContext, guard: Guard) -> None:
    page = resources.files("distvideo.serving").joinpath("static/index.html").read_text()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        """200 once the model is loaded and jobs run; 503 while loading, stopping, or after the engine failed."""
        body = Health(
            status=ctx.service.health,  # type: ignore[arg-type]
            detail=ctx.service.health_detail,
            executor=ctx.executor,
            world_size=ctx.world_size,
            replicas=_replica_health(ctx.board),
        )
        shown = body.model_dump(exclude={"replicas"} if body.replicas is None else None)
        return JSONResponse(shown, status_code=200 if body.status == OK else 503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        dependencies=guard.dependencies,
        responses={**guard.errors_as_json, 200: {"content": {metrics.CONTENT_TYPE: {"schema": {"type": "string"}}}}},
    )
    async def get_metrics() -> PlainTextResponse:
        """Prometheus text: queue depth, jobs by status, rejections, seconds per stage, busy replicas and each
        replica's jobs and seconds."""
        return PlainTextResponse(metrics.render(ctx.service, ctx.store, ctx.board), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, dependencies=guard.dependencies, responses=guard.errors)
    async def list_models() -> ModelList:
        info = ctx.admission.model
        card = ModelCard(
            id=ctx.admission.model_id,
            created=int(info.path.stat().st_mtime),
            family=info.class_name,
            defaults={k: float(v) for k, v in info.defaults.items()},
            spatial_stride=info.spatial_stride,
            frames_per_latent=info.vae_scale_temporal,
            image_input=ctx.admission.takes_image,
            lora_adapters=sorted(ctx.admission.adapters),
            example_prompt=example_prompt(info.path, ctx.admission.takes_image),
        )
        return ModelList(data=[card])


def _add_create_route(app: FastAPI, ctx: AppContext, guard: Guard) -> None:
    @app.post(
        "/v1/videos",
        response_model=Video,
        dependencies=guard.dependencies,
        openapi_extra={"requestBody": _create_body_schema()},
        responses={
            **guard.errors,
            400: ERROR_RESPONSE,
            413: ERROR_RESPONSE,
            415: ERROR_RESPONSE,
            422: ERROR_RESPONSE,
            429: {**ERROR_RESPONSE, "headers": {"Retry-After": {"schema": {"type": "integer"}}}},
            503: ERROR_RESPONSE,
        },
    )
    async def create_video(request: Request) -> Video:
        """Queue a job (JSON, or multipart/form-data with an input_reference image). Checked against the model and the
        server's limits before it is queued; 429 with Retry-After when the queue is full."""
        job_id = "video_" + secrets.token_hex(12)
        image_path = ctx.admission.output / f"{job_id}.input"  # named by the server, as the video is
        try:
            body, image = await read_create_body(request)
            if image is not None and not ctx.admission.takes_image:
                ctx.admission.admit(body, job_id, image_path="input_reference")  # raises the 422 naming the field
            if image is not None:  # every rank reads the file (a path crosses the launcher's job channel)
                image_path.write_bytes(await image.read())
            api, resolved = ctx.admission.admit(body, job_id, image_path=None if image is None else str(image_path))
            if not ctx.service.accepting:
                raise ApiError(
                    503, f"the server is not accepting jobs: {ctx.service.health_detail}", code="unavailable"
                )
        except ConfigError as exc:  # a check below admission's own (which answers ApiError) refusing the input
            image_path.unlink(missing_ok=True)
            ctx.service.counters.rejected["invalid"] += 1
            raise ctx.admission.refusal(exc, image_path=str(image_path)) from None
        except ApiError as exc:
            image_path.unlink(missing_ok=True)
            if exc.status in (400, 415, 422):
                ctx.service.counters.rejected["invalid"] += 1
            raise
        except BaseException:  # whatever failed (a 500, a cancelled request), the upload is not left behind
            image_path.unlink(missing_ok=True)
            raise
        try:
            record = ctx.store.insert(
                JobRecord(
                    id=job_id,
                    status=QUEUED,
                    model=ctx.admission.model_id,
                    params={"api": api},
                    created_at=int(time.time()),
                )
            )
        except BaseException:
            image_path.unlink(missing_ok=True)
            raise
        lora = None if body.lora is None else (body.lora.name, body.lora.strength)
        try:
            ctx.service.enqueue(QueuedJob(id=job_id, request=resolved, lora=lora, client=_client(ctx, request)))
        except QueueFull:
            ctx.store.delete(job_id)
            image_path.unlink(missing_ok=True)
            raise ApiError(
                429,
                f"the queue is full ({ctx.service.max_queue} jobs waiting); retry later",
                code="queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": str(ctx.service.retry_after())},
            ) from None
        except ServiceClosed as exc:
            ctx.store.delete(job_id)
            image_path.unlink(missing_ok=True)
            raise ApiError(503, f"the server is not accepting jobs: {exc}", code="unavailable") from None
        except BaseException:
            ctx.store.delete(job_id)
            image_path.unlink(missing_ok=True)
            raise
        return Video.of(record)


def _add_read_routes(app: FastAPI, ctx: AppContext, guard: Guard) -> None:
    @app.get(
        "/v1/videos",
        response_model=VideoList,
        dependencies=guard.dependencies,
        responses={**guard.errors, 422: ERROR_RESPONSE},
    )
    async def list_videos(
        limit: int = Query(20, ge=1, le=100),
        after: str | None = Query(None, max_length=200, description="the last id of the previous page"),
        order: Literal["desc", "asc"] = Query("desc", description="desc: newest first"),
    ) -> VideoList:
        try:
            records, more = ctx.store.page(limit=limit, after=after, newest_first=order == "desc")
        except KeyError:
            raise ApiError(422, f"after={after!r}: no video has this id", param="after") from None
        data = [Video.of(r) for r in records]
        return VideoList(
            data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=more
        )

    @app.get(
        "/v1/videos/{video_id}",
        response_model=Video,
        dependencies=guard.dependencies,
        responses={**guard.errors, 404: ERROR_RESPONSE},
    )
    async def get_video(video_id: str) -> Video:
        return Video.of(_record(ctx, video_id))

    @app.get(
        "/v1/videos/{video_id}/content",
        response_class=FileResponse,
        dependencies=guard.dependencies,
        responses={
            **guard.errors,
            200: {"content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}},
            206: {
                "description": "the requested byte range",
                "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}},
            },
            404: ERROR_RESPONSE,
            409: ERROR_RESPONSE,
            416: {"description": "the requested range is outside the file", "content": {"text/plain": {}}},
        },
    )
    async def get_content(video_id: str) -> FileResponse:
        """The MP4 of a completed job; supports Range requests (206)."""
        record = _record(ctx, video_id)
        if record.status != COMPLETED or not record.file:
            raise ApiError(409, f"video {video_id} has no content: its status is {record.status}", code="not_ready")
        path = ctx.admission.output / record.file
        if "/" in record.file or not path.is_file():
            raise ApiError(404, f"the file of video {video_id} is gone from the output folder", code="file_missing")
        return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")


def _add_events_route(app: FastAPI, ctx: AppContext, guard: Guard) -> None:
    async def job(video_id: str) -> JobRecord:  # a dependency: an unknown id is a 404 before the stream starts
        return _record(ctx, video_id)

    @app.get(
        "/v1/videos/{video_id}/events",
        response_class=EventSourceResponse,
        dependencies=guard.dependencies,
        # the route's own type is text/event-stream; its errors are JSON like every other route's
        responses={
            **guard.errors_as_json,
            404: {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}},
        },
    )
    async def video_events(record: JobRecord = Depends(job)) -> AsyncIterator[VideoEvent]:
        """Server-sent events of the job: what happened so far, then each change as it happens (queued, started,
        progress after every denoising step), until it completed or failed."""
        async for event in ctx.events.follow(record):
            yield VideoEvent.model_validate(event)


def _record(ctx: AppContext, video_id: str) -> JobRecord:
    record = ctx.store.get(video_id)
    if record is None:
        raise ApiError(404, f"no video with id {video_id!r}", param="video_id", code="not_found")
    return record


def _add_delete_route(app: FastAPI, ctx: AppContext, guard: Guard) -> None:
    @app.delete(
        "/v1/videos/{video_id}",
        response_model=VideoDeleted,
        dependencies=guard.dependencies,
        responses={
            **guard.errors,
            202: {"model": Video, "description": "the running job will stop"},
            404: ERROR_RESPONSE,
        },
    )
    async def delete_video(video_id: str) -> Any:
        """Queued: removed. Running: cancelled after its current denoising step (202; it ends failed with error code
        'cancelled'). Finished: deleted with its file."""
        record = _record(ctx, video_id)
        if record.status == QUEUED and ctx.service.remove_queued(video_id):
            ctx.store.delete(video_id)
            (ctx.admission.output / f"{video_id}.input").unlink(missing_ok=True)
            return VideoDeleted(id=video_id, deleted=True)
        if record.status in (QUEUED, IN_PROGRESS):  # queued a moment ago: the engine loop just took it
            ctx.cancel_running(video_id)
            return JSONResponse(Video.of(_record(ctx, video_id)).model_dump(), status_code=202)
        ctx.store.delete(video_id)
        (ctx.admission.output / f"{video_id}.input").unlink(missing_ok=True)
        if record.file and "/" not in record.file:
            (ctx.admission.output / record.file).unlink(missing_ok=True)
        return VideoDeleted(id=video_id, deleted=True)
