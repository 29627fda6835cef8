"""OpenAI's routes (/v1/models, /v1/completions, /v1/chat/completions) in OpenAI's exact
shapes, so the `openai` package, AIPerf and other OpenAI-compatible clients work unchanged.
Prefix-cache hits show as `usage.prompt_tokens_details.cached_tokens`, as OpenAI reports them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from hicache.runtime.serving import params
from hicache.runtime.serving.backend import GenerateRequest
from hicache.runtime.serving.context import Context, Stream, context, generation_route, gone
from hicache.runtime.serving.errors import JSON, ApiError, bad_request, dumps, show, unavailable
from hicache.runtime.serving.generation import Generation, Job, aclose_shielded
from hicache.runtime.serving.params import Unsupported
from hicache.runtime.serving.sse import DONE, event

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: all the room left
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

_UNSUPPORTED = (
    Unsupported("n", (None, 1)),
    Unsupported("best_of", (None, 1)),
    Unsupported("logprobs", (None, False)),
    Unsupported("top_logprobs", (None, 0)),
    Unsupported("echo", (None, False)),
    Unsupported("suffix", (None,)),
    Unsupported("frequency_penalty", (None, 0)),
    Unsupported("presence_penalty", (None, 0)),
    Unsupported("repetition_penalty", (None, 1)),
    Unsupported("min_tokens", (None, 0)),
    Unsupported("logit_bias", (None, {})),
    Unsupported("tools", (None, [])),
    Unsupported("response_format", (None, {"type": "text"})),
)


def check_model(ctx: Context, body: dict[str, Any]) -> None:
    """`model` may be left out (the node serves one); any other name is OpenAI's 404."""
    model = body.get("model")
    if model is not None and model != ctx.model_name:
        raise ApiError(
            404,
            f"The model {show(model)} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            code="model_not_found",
        )


def include_usage(body: dict[str, Any], streaming: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if not streaming:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    usage = opts.get("include_usage")
    return False if usage is None else params.boolean(usage, "stream_options.include_usage")


async def prompt_ids(ctx: Context, prompt: object) -> list[int]:
    """/v1/completions' `prompt`: a string or token ids, or a list holding exactly one of them."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request("batches are not supported: send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await ctx.encode(params.text(prompt, "prompt"), "prompt")
    if isinstance(prompt, list):
        return params.token_ids(prompt, "prompt", ctx.info.vocab_size, ctx.info.max_context_tokens)
    raise bad_request(f"'prompt' must be a string or a list of token ids, not {show(prompt)}", "prompt")


def chat_messages(raw: object) -> list[dict[str, str]]:
    """`messages` with string contents (text parts joined), as a chat template takes them."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for n, msg in enumerate(raw):
        where = f"messages[{n}]"
        if not isinstance(msg, dict):
            raise bad_request(f"'{where}' must be an object", where)
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(
                f"'{where}.role' must be one of {sorted(ROLES)}, not {show(role)}", where + ".role"
            )
        out.append({"role": role, "content": _content(msg.get("content"), where + ".content")})
    return out


def _content(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return params.text(content, where, allow_empty=True)
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of text parts", where)
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_request(f"'{where}' may hold only parts of type 'text', not {show(part)}", where)
        parts.append(params.text(part.get("text"), where + ".text", allow_empty=True))
    return "".join(parts)


async def parse(
    ctx: Context, body: dict[str, Any], tenant: str | None, *, chat: bool
) -> tuple[Job, bool, bool]:
    """A request as a Job, whether it streams, and whether the stream ends with usage."""
    check_model(ctx, body)
    params.refuse_unsupported(body, _UNSUPPORTED)
    if chat:
        input_ids = await ctx.chat_prompt(chat_messages(body.get("messages")))
    else:
        input_ids = await prompt_ids(ctx, body.get("prompt"))
    s = params.sampling(
        body,
        max_keys=("max_completion_tokens", "max_tokens") if chat else ("max_tokens",),
        seed_keys=("seed",),
        vocab_size=ctx.info.vocab_size,
        max_context=ctx.info.max_context_tokens,
    )
    default = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    param = "messages" if chat else "prompt"
    max_new = params.settle_max_new_tokens(
        len(input_ids), s.max_new_tokens, default, ctx.info.max_context_tokens, param
    )
    streaming = False if body.get("stream") is None else params.boolean(body.get("stream"), "stream")
    usage = include_usage(body, streaming)
    # OpenAI's `user` names the end user: the conversation a session-affinity router keeps together.
    session = "" if body.get("user") is None else params.text(body.get("user"), "user", allow_empty=True)
    req = GenerateRequest(ctx.new_rid(), input_ids, max_new, s.spec, tenant, session)
    return Job("chat" if chat else "completions", req, s.stop), streaming, usage


def finish_reason(gen: Generation) -> str | None:
    return None if gen.finish is None else gen.finish.reason


def backend_failure(gen: Generation) -> ApiError:
    assert gen.finish is not None
    return unavailable(gen.finish.message or "the backend gave up on the request", code=gen.finish.reason)


class Shapes:
    """OpenAI's objects for one request: the whole answer, its stream chunks and usage."""

    def __init__(self, ctx: Context, gen: Generation, *, chat: bool, usage: bool) -> None:
        self.gen = gen
        self.chat = chat
        self.usage = usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + gen.rid
        self.created = int(time.time())
        self.model = ctx.model_name

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self) -> dict[str, Any]:
        gen = self.gen
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}}
        else:
            choice = {"index": 0, "text": gen.text}
        choice |= {"logprobs": None, "finish_reason": finish_reason(gen)}
        return self._head("chat.completion" if self.chat else "text_completion") | {
            "choices": [choice],
            "usage": gen.usage(),
        }

    def chunk(self, piece: str | None, finish: str | None = None, *, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if piece:
                delta["content"] = piece
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": piece or ""}
        choice |= {"logprobs": None, "finish_reason": finish}
        out = self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [choice]}
        if self.usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return head | {"choices": [], "usage": self.gen.usage()}


async def sse_body(shapes: Shapes, stream: Stream) -> AsyncGenerator[bytes, None]:
    gen = shapes.gen
    pieces = stream.pieces()
    try:
        if shapes.chat:
            yield event(shapes.chunk(None, role=True))
        async for piece in pieces:
            if piece:
                yield event(shapes.chunk(piece))
        if gen.failed:
            # OpenAI's clients raise on an `error` object in a stream.
            yield b"data: " + dumps(backend_failure(gen).body()).encode("ascii") + b"\n\n"
        else:
            yield event(shapes.chunk(None, finish_reason(gen)))
            if shapes.usage:
                yield event(shapes.usage_chunk())
        yield DONE
    finally:
        await aclose_shielded(pieces)


def endpoint(chat: bool) -> Callable[[Request], Any]:
    async def handle(request: Request) -> Response:
        ctx = context(request)
        principal = ctx.auth.principal(request)
        job, streaming, usage = await parse(
            ctx, await params.read_json(request, ctx.max_body_bytes), principal.tenant, chat=chat
        )
        gen = ctx.generation(request, job)
        shapes = Shapes(ctx, gen, chat=chat, usage=usage)
        if streaming:
            stream = await ctx.start_stream(request, gen)
            return gone() if stream is None else ctx.event_stream(gen, sse_body(shapes, stream))
        if not await ctx.run_to_end(request, gen):
            return gone()
        if gen.failed:
            raise backend_failure(gen)
        return JSON(shapes.whole())

    return generation_route("chat" if chat else "completions")(handle)


def _model_card(ctx: Context) -> dict[str, Any]:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "hicache",
        "max_model_len": ctx.info.max_context_tokens,
    }


async def list_models(request: Request) -> Response:
    ctx = context(request)
    ctx.auth.principal(request)
    return JSON({"object": "list", "data": [_model_card(ctx)]})


async def get_model(request: Request) -> Response:
    ctx = context(request)
    ctx.auth.principal(request)
    name = request.path_params["model"]
    check_model(ctx, {"model": name})
    return JSON(_model_card(ctx))


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    Route("/v1/completions", endpoint(chat=False), methods=["POST"]),
    Route("/v1/chat/completions", endpoint(chat=True), methods=["POST"]),
]
