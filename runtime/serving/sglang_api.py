"""SGLang's native routes, in the shapes SGLang's own clients read (bench_multiturn.py and
bench_serving: `data: {...}` lines with the cumulative text, then `data: [DONE]`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from hicache.runtime.serving import known_keys, logprob_shapes, params
from hicache.runtime.serving.backend import TIERS, GenerateRequest, Sampling, Tokens
from hicache.runtime.serving.context import (
    Context,
    Piece,
    Stream,
    context,
    generation_route,
    gone,
    interleave,
)
from hicache.runtime.serving.errors import JSON, bad_request, show, unavailable
from hicache.runtime.serving.generation import Generation, Job, aclose_shielded
from hicache.runtime.serving.logprob_shapes import TokenTexts
from hicache.runtime.serving.metrics import CACHE_SOURCES
from hicache.runtime.serving.openai_api import usage_options
from hicache.runtime.serving.params import Unsupported
from hicache.runtime.serving.sse import DONE, EventStream, event
from hicache.runtime.wire.sampling_fields import MAX_TOP_LOGPROBS

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_TIMEOUT_S = 30.0

_UNSUPPORTED_TOP = (
    Unsupported("lora_path", (None, "")),
    Unsupported("image_data", (None,)),
)
_UNSUPPORTED_SAMPLING = (
    Unsupported("n", (None, 1)),
    Unsupported("min_new_tokens", (None, 0)),
    Unsupported("regex", (None,)),
    Unsupported("json_schema", (None,)),
    Unsupported("ebnf", (None,)),
)


def _per_prompt(value: object, n: int, param: str) -> list[Any]:
    """A batch field: one value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise bad_request(f"'{param}' holds {len(value)} items for {n} prompts", param)
    return value


async def parse_generate(
    ctx: Context, body: dict[str, Any], tenant: str | None
) -> tuple[list[Job], bool, bool]:
    """A /generate body as its Jobs (one per prompt), whether it is a batch (a list of texts or
    of token-id lists: answered with a list), and whether it streams."""
    known_keys.refuse_unknown(body, known_keys.GENERATE)
    params.refuse_unsupported(body, _UNSUPPORTED_TOP + known_keys.GENERATE_NEUTRAL)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("give exactly one of 'text' and 'input_ids'")
    batch = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    prompts: list[Any] = (text if text is not None else ids) if batch else [text if text is not None else ids]
    if not prompts:
        raise bad_request("the batch is empty", "text" if text is not None else "input_ids")
    stream = False if body.get("stream") is None else params.boolean(body.get("stream"), "stream")
    # SGLang's own multi-turn kit sends OpenAI's `stream_options` here too; every chunk's
    # meta_info already carries the usage so far, so a well-formed one changes nothing.
    usage_options(body, stream)
    raws = (
        _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params")
        if batch
        else [body.get("sampling_params")]
    )
    rids = _per_prompt(body.get("rid"), len(prompts), "rid") if batch else [body.get("rid")]
    session = session_id(body)
    jobs = []
    for n, (prompt, raw, rid) in enumerate(zip(prompts, raws, rids, strict=True)):
        where = f"[{n}]" if batch else ""
        if text is not None:
            input_ids = await ctx.encode(params.text(prompt, "text" + where))
        else:
            input_ids = params.token_ids(
                prompt, "input_ids" + where, ctx.info.vocab_size, ctx.info.max_context_tokens
            )
        jobs.append(_job(ctx, body, input_ids, {} if raw is None else raw, rid, tenant, session, where))
    return jobs, batch, stream


def _job(
    ctx: Context,
    body: dict[str, Any],
    input_ids: list[int],
    raw: object,
    rid: object,
    tenant: str | None,
    session: str,
    where: str,
) -> Job:
    param = "sampling_params" + where
    if not isinstance(raw, dict):
        raise bad_request(f"'{param}' must be an object", param)
    known_keys.refuse_unknown(raw, known_keys.SAMPLING, param + ".")
    params.refuse_unsupported(raw, _UNSUPPORTED_SAMPLING + known_keys.SAMPLING_NEUTRAL, param + ".")
    s = params.sampling(
        raw,
        max_keys=("max_new_tokens",),
        seed_keys=("seed", "sampling_seed"),
        vocab_size=ctx.info.vocab_size,
        max_context=ctx.info.max_context_tokens,
        where=param + ".",
    )
    keep = raw.get("no_stop_trim")
    keep = False if keep is None else params.boolean(keep, param + ".no_stop_trim")
    max_new = params.settle_max_new_tokens(
        len(input_ids), s.max_new_tokens, DEFAULT_MAX_NEW_TOKENS, ctx.info.max_context_tokens, "text" + where
    )
    spec, start = logprob_spec(body, s.spec, len(input_ids))
    req = GenerateRequest(ctx.new_rid(), input_ids, max_new, spec, tenant, session)
    public = params.request_id(rid, "rid" + where)
    return Job("generate", req, s.stop, public, no_stop_trim=keep, input_logprobs_from=start)


def logprob_spec(body: dict[str, Any], spec: Sampling, prompt_len: int) -> tuple[Sampling, int]:
    """SGLang's `return_logprob`, `top_logprobs_num`, `logprob_start_len` and
    `return_text_in_logprobs`, checked, into `spec`; and where `input_token_logprobs` start (-1:
    none). As SGLang, -1 (its default) starts at the prompt's last token, whose entry is None
    (`params.scoring_prompt_from`); a start past the prompt gives none."""
    asked = body.get("return_logprob") is not None and params.boolean(
        body["return_logprob"], "return_logprob"
    )
    raw_top = body.get("top_logprobs_num")
    top = 0 if raw_top is None else params.integer(raw_top, "top_logprobs_num", 0, MAX_TOP_LOGPROBS)
    raw_start = body.get("logprob_start_len")
    start = -1 if raw_start is None else params.integer(raw_start, "logprob_start_len", -1, 2**31)
    if body.get("return_text_in_logprobs") is not None:
        params.boolean(body["return_text_in_logprobs"], "return_text_in_logprobs")
    if not asked:
        return spec, -1
    names = {"logprobs": "return_logprob", "top_logprobs": "top_logprobs_num"}
    spec = params.with_logprobs(spec, True, top, names)
    start = prompt_len - 1 if start == -1 else start
    if start >= prompt_len:
        return spec, -1
    return params.scoring_prompt_from(spec, start, prompt_len), start


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
    """SGLang's meta_info; `cached_tokens_details` under SGLang's names (device, host, storage)
    and ours (l1, l2, l3)."""
    details = {CACHE_SOURCES[tier]: gen.cached[tier] for tier in TIERS}
    return {
        "id": gen.job.public_id or gen.rid,
        "finish_reason": finish_reason(gen),
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": len(gen.output_ids),
        "cached_tokens": sum(gen.cached.values()),
        "cached_tokens_details": details | {tier: gen.cached[tier] for tier in TIERS},
        "e2e_latency": gen.elapsed_s,
    }


def logprob_info(gen: Generation, texts: TokenTexts, with_text: bool) -> dict[str, Any]:
    """SGLang's log-probability fields of `meta_info` (none unless `return_logprob`)."""
    spec = gen.job.request.sampling
    if not spec.logprobs:
        return {}
    chosen, top = logprob_shapes.sglang(texts, gen.output_ids, gen.logprobs, with_text)
    start = gen.job.input_logprobs_from
    ids = gen.job.request.input_ids[start:] if start >= 0 else []
    scores = gen.prompt_scores() if spec.prompt_logprobs_from >= 0 else [None] * len(ids)
    chosen_in, top_in = logprob_shapes.sglang(texts, ids, scores, with_text, prompt=True)
    out: dict[str, Any] = {"input_token_logprobs": chosen_in, "output_token_logprobs": chosen}
    if spec.top_logprobs:
        out["input_top_logprobs"] = top_in
        out["output_top_logprobs"] = top
    return out


def snapshot(gen: Generation, texts: TokenTexts | None = None, with_text: bool = False) -> dict[str, Any]:
    meta = meta_info(gen)
    if texts is not None:
        meta |= logprob_info(gen, texts, with_text)
    return {"text": gen.text, "output_ids": list(gen.output_ids), "meta_info": meta}


async def sse_body(
    gen: Generation, stream: Stream, texts: TokenTexts, with_text: bool
) -> AsyncGenerator[bytes, None]:
    pieces = stream.pieces()
    try:
        said_finish = False  # the last line carries finish_reason, once
        async for _ in pieces:
            line = snapshot(gen, texts, with_text)
            said_finish = line["meta_info"]["finish_reason"] is not None
            yield event(line)
        if not said_finish:
            yield event(snapshot(gen, texts, with_text))
        yield DONE
    finally:
        await aclose_shielded(pieces)


async def batch_sse_body(
    gens: Sequence[Generation],
    receive: trio.MemoryReceiveChannel[Piece],
    texts: TokenTexts,
    with_text: bool,
) -> AsyncGenerator[bytes, None]:
    """A streamed batch as SGLang streams one: each prompt's snapshots as its tokens come,
    interleaved, each with the prompt's `index` in the batch; one `[DONE]` after the last."""
    async with receive:
        said_finish = [False] * len(gens)
        left = len(gens)
        async for i, piece in receive:
            if piece is not None or not said_finish[i]:  # the last line carries finish_reason, once
                line = snapshot(gens[i], texts, with_text) | {"index": i}
                said_finish[i] = line["meta_info"]["finish_reason"] is not None
                yield event(line)
            if piece is None:
                left -= 1
                if not left:
                    break
        yield DONE


@generation_route("generate")
async def generate(request: Request) -> Response:
    ctx = context(request)
    principal = ctx.auth.principal(request)
    body = await params.read_json(request, ctx.max_body_bytes)
    jobs, batch, streaming = await parse_generate(ctx, body, principal.tenant)
    with_text = body.get("return_text_in_logprobs") is True
    texts = TokenTexts(ctx.codec)
    if batch and streaming:
        gens = [ctx.generation(request, job) for job in jobs]
        streams = await ctx.start_streams(request, gens)
        if streams is None:
            return gone()
        receive, producers = interleave(streams)

        def abort_all(reason: str) -> None:
            for gen in gens:
                gen.abort(reason)

        body = batch_sse_body(gens, receive, texts, with_text)
        return EventStream(body, producers, stall_s=ctx.stream_stall_timeout_s, on_stall=abort_all)
    if batch:
        gens = [ctx.generation(request, job) for job in jobs]
        if not await ctx.run_all_to_end(request, gens):
            return gone()
        for gen in gens:
            if gen.failed:
                raise gen.error()
        return JSON([snapshot(gen, texts, with_text) for gen in gens])
    gen = ctx.generation(request, jobs[0])
    if streaming:
        stream = await ctx.start_stream(request, gen)
        return gone() if stream is None else ctx.event_stream(gen, sse_body(gen, stream, texts, with_text))
    if not await ctx.run_to_end(request, gen):
        return gone()
    if gen.failed:
        raise gen.error()
    return JSON(snapshot(gen, texts, with_text))


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


async def ready(request: Request) -> Response:
    """SGLang's readiness probe: 200 once the server takes requests, while every node is up."""
    _check_nodes(context(request))
    return JSON({"status": "ready"})


async def get_model_info(request: Request) -> Response:
    """SGLang's /model_info (and its older name /get_model_info)."""
    ctx = context(request)
    ctx.auth.principal(request)
    return JSON(
        {
            "model_path": ctx.info.name,
            "tokenizer_path": ctx.info.name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
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
    """SGLang's /server_info (and /get_server_info): the server's settings under SGLang's names
    (its clients read `page_size` to count cache hits in whole pages, `max_total_num_tokens`
    and `internal_states`), then ours."""
    ctx = context(request)
    ctx.auth.principal(request)
    info, a = ctx.info, ctx.admission
    return JSON(
        {
            "version": _version(),
            "model_path": info.name,
            "tokenizer_path": info.name,
            "served_model_name": ctx.model_name,
            "served_model_names": list(ctx.model_names),
            "context_length": info.max_context_tokens,
            "page_size": ctx.page_size,
            "max_total_num_tokens": None if a is None or not a.max_tokens else a.max_tokens,
            "max_running_requests": None if a is None else a.max_running,
            "max_queued_requests": None if a is None else a.max_queued,
            "disaggregation_mode": "decode",
            "disable_radix_cache": False,
            "enable_hierarchical_cache": True,
            "skip_tokenizer_init": False,
            "is_embedding": False,
            "internal_states": [{"avg_spec_accept_length": None, "last_gen_throughput": None}],
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
    Route("/ready", ready, methods=["GET"]),
    Route("/model_info", get_model_info, methods=["GET"]),
    Route("/get_model_info", get_model_info, methods=["GET"]),
    Route("/server_info", get_server_info, methods=["GET"]),
    Route("/get_server_info", get_server_info, methods=["GET"]),
]
