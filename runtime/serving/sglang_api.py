"""SGLang's native routes, in the shapes SGLang's own clients read (bench_multiturn.py and
bench_serving: `data: {...}` lines with the cumulative text, then `data: [DONE]`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from hicache.runtime.serving import params
from hicache.runtime.serving.backend import TIERS, GenerateRequest, Sampling, Tokens
from hicache.runtime.serving.context import Context, Stream, context, generation_route, gone
from hicache.runtime.serving.errors import JSON, bad_request, show, unavailable
from hicache.runtime.serving.generation import Generation, Job, aclose_shielded
from hicache.runtime.serving.params import Unsupported
from hicache.runtime.serving.sse import DONE, event

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_TIMEOUT_S = 30.0

_UNSUPPORTED_TOP = (
    Unsupported("return_logprob", (None, False)),
    Unsupported("lora_path", (None, "")),
    Unsupported("image_data", (None,)),
)
_UNSUPPORTED_SAMPLING = (
    Unsupported("n", (None, 1)),
    Unsupported("min_new_tokens", (None, 0)),
    Unsupported("frequency_penalty", (None, 0)),
    Unsupported("presence_penalty", (None, 0)),
    Unsupported("repetition_penalty", (None, 1)),
    Unsupported("regex", (None,)),
    Unsupported("json_schema", (None,)),
    Unsupported("ebnf", (None,)),
)


async def parse_generate(ctx: Context, body: dict[str, Any], tenant: str | None) -> tuple[Job, bool]:
    """A /generate body as a Job, and whether it streams."""
    params.refuse_unsupported(body, _UNSUPPORTED_TOP)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("give exactly one of 'text' and 'input_ids'")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise bad_request("batches are not supported: send one prompt per request")
    if text is not None:
        input_ids = await ctx.encode(params.text(text, "text"))
    else:
        input_ids = params.token_ids(ids, "input_ids", ctx.info.vocab_size, ctx.info.max_context_tokens)
    raw = body.get("sampling_params")
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise bad_request("'sampling_params' must be an object", "sampling_params")
    params.refuse_unsupported(raw, _UNSUPPORTED_SAMPLING, "sampling_params.")
    s = params.sampling(
        raw,
        max_keys=("max_new_tokens",),
        seed_keys=("seed", "sampling_seed"),
        vocab_size=ctx.info.vocab_size,
        max_context=ctx.info.max_context_tokens,
        where="sampling_params.",
    )
    max_new = params.settle_max_new_tokens(
        len(input_ids), s.max_new_tokens, DEFAULT_MAX_NEW_TOKENS, ctx.info.max_context_tokens, "text"
    )
    stream = False if body.get("stream") is None else params.boolean(body.get("stream"), "stream")
    req = GenerateRequest(ctx.new_rid(), input_ids, max_new, s.spec, tenant, session_id(body))
    return Job("generate", req, s.stop, params.request_id(body.get("rid"), "rid")), stream


def session_id(body: dict[str, Any]) -> str:
    """SGLang's `session_params.id`: the conversation a session-affinity router keeps together."""
    raw = body.get("session_params")
    if raw is None:
        return ""
    if not isinstance(raw, dict):
        raise bad_request("'session_params' must be an object", "session_params")
    sid = raw.get("id")
    if sid is None:
        return ""
    if isinstance(sid, bool) or not isinstance(sid, str | int):
        where = "session_params.id"
        raise bad_request(f"'{where}' must be a string or an integer, not {show(sid)}", where)
    return params.text(str(sid), "session_params.id", allow_empty=True)


def finish_reason(gen: Generation) -> dict[str, Any] | None:
    f = gen.finish
    if f is None:
        return None
    if f.reason == "stop":
        return {"type": "stop", "matched": f.matched}
    if f.reason == "length":
        return {"type": "length", "length": gen.job.request.max_new_tokens}
    return {"type": "abort", "message": f.message or f.reason}


def meta_info(gen: Generation) -> dict[str, Any]:
    return {
        "id": gen.job.public_id or gen.rid,
        "finish_reason": finish_reason(gen),
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": len(gen.output_ids),
        "cached_tokens": sum(gen.cached.values()),
        "cached_tokens_details": {tier: gen.cached[tier] for tier in TIERS},
        "e2e_latency": gen.elapsed_s,
    }


def snapshot(gen: Generation) -> dict[str, Any]:
    return {"text": gen.text, "output_ids": list(gen.output_ids), "meta_info": meta_info(gen)}


async def sse_body(gen: Generation, stream: Stream) -> AsyncGenerator[bytes, None]:
    pieces = stream.pieces()
    try:
        said_finish = False  # the last line carries finish_reason, once
        async for _ in pieces:
            line = snapshot(gen)
            said_finish = line["meta_info"]["finish_reason"] is not None
            yield event(line)
        if not said_finish:
            yield event(snapshot(gen))
        yield DONE
    finally:
        await aclose_shielded(pieces)


@generation_route("generate")
async def generate(request: Request) -> Response:
    ctx = context(request)
    principal = ctx.auth.principal(request)
    job, streaming = await parse_generate(
        ctx, await params.read_json(request, ctx.max_body_bytes), principal.tenant
    )
    gen = ctx.generation(request, job)
    if streaming:
        stream = await ctx.start_stream(request, gen)
        return gone() if stream is None else ctx.event_stream(gen, sse_body(gen, stream))
    if not await ctx.run_to_end(request, gen):
        return gone()
    if gen.failed:
        assert gen.finish is not None
        raise unavailable(gen.finish.message or "the backend gave up on the request", code=gen.finish.reason)
    return JSON(snapshot(gen))


async def flush_cache(request: Request) -> Response:
    ctx = context(request)
    ctx.auth.principal(request, admin=True)
    try:
        await ctx.backend.flush()
    except Exception as exc:
        raise unavailable(f"the cache was not flushed: {exc}", code="flush_refused") from None
    return PlainTextResponse("Cache flushed.\n")


def _check_nodes(ctx: Context) -> None:
    """A 503 naming the node that is down, when the front door knows one is."""
    problem = ctx.health.problem()
    if problem is not None:
        raise unavailable(f"unhealthy: {problem}", code="unhealthy")


async def health(request: Request) -> Response:
    """200 while every node behind the front door is up (a node that exited, or an attached
    node that stopped answering its checks, is a 503 at once)."""
    _check_nodes(context(request))
    return Response(status_code=200)


async def health_generate(request: Request) -> Response:
    """A one-token generation through the whole path, as SGLang's probe does; a 503 at once
    while a node is known to be down. It does not wait in the front door's queue: a probe
    says whether the path works, not how busy it is."""
    ctx = context(request)
    _check_nodes(ctx)
    prompt = ctx.codec.encode("Hi") or [0]
    req = GenerateRequest("health-" + ctx.new_rid(), prompt[: ctx.info.max_context_tokens - 1], 1, Sampling())
    events = ctx.backend.generate(req)
    reason = "timed out"
    try:
        with trio.move_on_after(HEALTH_TIMEOUT_S):
            async for ev in events:
                if not isinstance(ev, Tokens):
                    reason = ev.reason
                    break
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    finally:
        await aclose_shielded(events)
    if reason not in ("stop", "length"):
        raise unavailable(f"the health generation failed: {reason}", code="unhealthy")
    return Response(status_code=200)


async def get_model_info(request: Request) -> Response:
    ctx = context(request)
    ctx.auth.principal(request)
    return JSON(
        {
            "model_path": ctx.info.name,
            "tokenizer_path": ctx.info.name,
            "is_generation": True,
            "served_model_name": ctx.model_name,
            "max_context_tokens": ctx.info.max_context_tokens,
        }
    )


def _version() -> str:
    try:
        return version("hicache")
    except PackageNotFoundError:
        return "unknown"


async def get_server_info(request: Request) -> Response:
    ctx = context(request)
    ctx.auth.principal(request)
    info = ctx.info
    return JSON(
        {
            "version": _version(),
            "model_path": info.name,
            "served_model_name": ctx.model_name,
            "context_length": info.max_context_tokens,
            "vocab_size": info.vocab_size,
            "eos_token_ids": list(info.eos_token_ids),
            "default_max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
            "max_body_bytes": ctx.max_body_bytes,
            "api_keys": ctx.auth.enabled,
            "cache_tiers": list(TIERS),
        }
    )


ROUTES = [
    Route("/generate", generate, methods=["POST"]),
    Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/health_generate", health_generate, methods=["GET"]),
    Route("/get_model_info", get_model_info, methods=["GET"]),
    Route("/get_server_info", get_server_info, methods=["GET"]),
]
