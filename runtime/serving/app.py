"""The decode node's HTTP front door: SGLang's and OpenAI's APIs over one `Backend`."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import trio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from hicache.runtime.serving import openai_api, params, sglang_api
from hicache.runtime.serving.admission import Admission
from hicache.runtime.serving.auth import Auth, KeyLookup, PrincipalLike
from hicache.runtime.serving.backend import Backend, TextCodec
from hicache.runtime.serving.context import Context, context
from hicache.runtime.serving.door import Door, DoorLimits, DoorMiddleware
from hicache.runtime.serving.errors import JSON, ApiError, error_response
from hicache.runtime.serving.health import Health
from hicache.runtime.serving.metrics import Metrics
from hicache.runtime.serving.token_rate import TokenRate
from hicache.runtime.serving.trace_recorder import RecordingError, TraceRecorder

log = logging.getLogger("hicache.runtime.serving")

MAX_BODY_BYTES = 16 * 1024 * 1024
STATS_TIMEOUT_S = 5.0


async def metrics(request: Request) -> Response:
    """Prometheus text; the backend's gauges are read fresh for each scrape."""
    ctx = context(request)
    ctx.auth.principal(request, admin=True)
    try:
        with trio.fail_after(STATS_TIMEOUT_S):
            ctx.metrics.set_backend_stats(await ctx.backend.stats())
    except Exception as exc:  # a scrape still shows the front door's own metrics
        log.warning("backend stats unavailable for /metrics: %s: %s", type(exc).__name__, exc)
        ctx.metrics.set_backend_stats({})
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def start_trace_recording(request: Request) -> Response:
    """Start recording a trace (admin): into `path` (JSON body, optional) under the directory the
    operator allowed, else a new file there; 409 while one is recording or if the file exists."""
    ctx = context(request)
    ctx.auth.principal(request, admin=True)
    empty = request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers
    body = {} if empty else await params.read_json(request, ctx.max_body_bytes)
    name = None if body.get("path") is None else params.text(body["path"], "path")
    try:
        rec = ctx.recorder.start(ctx.recorder.resolve(name))
    except RecordingError as exc:
        raise ApiError(
            409 if exc.conflict else 400, str(exc), param="path", code="recording_refused"
        ) from None
    return JSON(rec.status())


async def stop_trace_recording(request: Request) -> Response:
    """Stop recording (admin); answers what was recorded, or {"recording": false} if nothing was."""
    ctx = context(request)
    ctx.auth.principal(request, admin=True)
    rec = ctx.recorder.stop()
    return JSON({"recording": False} if rec is None else rec.status())


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    log.warning("%s %s refused with %d: %s", request.method, request.url.path, exc.status, exc.message)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (404 route, 405 method) in the same JSON shape."""
    assert isinstance(exc, HTTPException)
    log.warning("%s %s refused with %d: %s", request.method, request.url.path, exc.status_code, exc.detail)
    err = ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code))
    response = error_response(err)
    response.headers.update(exc.headers or {})
    return response


def create_app(
    backend: Backend,
    codec: TextCodec,
    *,
    model_name: str,
    api_keys: KeyLookup | Mapping[str, PrincipalLike] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    recorder: TraceRecorder | None = None,
    admission: Admission | None = None,
    health: Health | None = None,
    shared_open_cache: bool = False,
    aliases: Sequence[str] = (),
    page_size: int = 1,
    limits: DoorLimits | None = None,
    stream_stall_timeout_s: float | None = None,
    rate: TokenRate | None = None,
) -> Starlette:
    """An ASGI app for `backend`; `codec` tokenizes prompts and detokenizes output.

    `api_keys`: runtime/security/api_keys.py's `ApiKeys` (or a mapping key -> principal); when given,
    every route but /health and /health_generate needs `Authorization: Bearer KEY`, the key's
    tenant goes into each `GenerateRequest`, and /flush_cache and /metrics need an admin key.
    `recorder`: where traces of the requests served are recorded (trace_recorder.py); its
    start and stop routes need an admin key too. Without keys each caller's cache is its own
    unless `shared_open_cache` (auth.py). `admission`: the bounded queue requests wait
    in before they reach the backend (admission.py; None: none); `health`: what the front door
    knows of the nodes behind it, which /health and /health_generate answer by (health.py).
    `model_name` is the name responses and metrics carry; clients may also call the model by
    any of `aliases` (SGLang's repeatable --served-model-name). `page_size`: the decode nodes'
    tokens per KV page, as SGLang's /server_info reports it.
    `limits`: what a client may hold at the door (door.py; `max_body_bytes` when not given);
    `stream_stall_timeout_s`: a stream whose client reads nothing for that long is aborted
    (sse.py; None: never); `rate`: each caller's tokens per minute (token_rate.py; None: no limit).
    """
    limits = DoorLimits(max_body_bytes=max_body_bytes) if limits is None else limits
    auth = Auth(api_keys, shared_open_cache=shared_open_cache)
    door = Door(limits)
    app = Starlette(
        routes=[
            *sglang_api.ROUTES,
            *openai_api.ROUTES,
            Route("/metrics", metrics, methods=["GET"]),
            Route("/start_trace_recording", start_trace_recording, methods=["POST"]),
            Route("/stop_trace_recording", stop_trace_recording, methods=["POST"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error},
        middleware=[Middleware(DoorMiddleware, door=door, auth=auth)],
    )
    ctx_metrics = Metrics(model_name)
    if admission is not None:
        ctx_metrics.watch(admission)
    app.state.ctx = Context(
        backend=backend,
        codec=codec,
        model_name=model_name,
        info=backend.model_info(),
        auth=auth,
        metrics=ctx_metrics,
        max_body_bytes=limits.max_body_bytes,
        started_at=time.time(),
        recorder=recorder if recorder is not None else TraceRecorder(model_name),
        admission=admission,
        health=health if health is not None else Health(),
        aliases=tuple(aliases),
        page_size=page_size,
        door=door,
        stream_stall_timeout_s=stream_stall_timeout_s,
        rate=rate,
    )
    return app
