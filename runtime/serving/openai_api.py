"""OpenAI's routes (/v1/models, /v1/completions, /v1/chat/completions) in OpenAI's exact
shapes, so the `openai` package, AIPerf and other OpenAI-compatible clients work unchanged.
Prefix-cache hits show as `usage.prompt_tokens_details.cached_tokens`, as OpenAI reports them.

A request may ask for `n` choices, and /v1/completions for several prompts: each choice is a
generation of its own, run side by side (`openai_shapes.py` answers for them together).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from hicache.runtime.serving import known_keys, params
from hicache.runtime.serving.backend import GenerateRequest
from hicache.runtime.serving.context import Context, context, generation_route, gone
from hicache.runtime.serving.errors import JSON, ApiError, bad_request, show
from hicache.runtime.serving.generation import Job
from hicache.runtime.serving.openai_shapes import Plan, Shapes
from hicache.runtime.serving.params import Unsupported
from hicache.runtime.wire.sampling_fields import MAX_TOP_LOGPROBS, Sampling, seed_for

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: all the room left
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

MAX_N = 16  # choices per prompt
MAX_CHOICES = 128  # choices per request: prompts times n
_UNSUPPORTED = (
    Unsupported("best_of", (None, 1)),
    Unsupported("suffix", (None,)),
    Unsupported("min_tokens", (None, 0)),
    Unsupported("response_format", (None, {"type": "text"})),
    # Choosing a tool for the model needs constrained decoding; "auto" leaves it to the model.
    Unsupported("tool_choice", (None, "auto", "none")),
)


def check_model(ctx: Context, body: dict[str, Any]) -> None:
    """`model` may be left out (the node serves one) or be any name it is served under
    (--served-model-name); any other name is OpenAI's 404."""
    model = body.get("model")
    if model is not None and model not in ctx.model_names:
        names = " or ".join(repr(n) for n in ctx.model_names)
        raise ApiError(
            404,
            f"The model {show(model)} does not exist; this server serves {names}",
            param="model",
            code="model_not_found",
        )


STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


def usage_options(body: dict[str, Any], streaming: bool) -> tuple[bool, bool]:
    """`stream_options`: a last chunk with the usage (OpenAI's `include_usage`), and the usage so
    far in every chunk as well (vLLM's `continuous_usage_stats`, which needs `include_usage`)."""
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if not streaming:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    for key in opts:
        if key not in STREAM_OPTIONS:
            name = f"stream_options.{key}"
            raise bad_request(
                f"{show(name)} is not a known option (known: {', '.join(sorted(STREAM_OPTIONS))})", name
            )
    usage = opts.get("include_usage")
    last = False if usage is None else params.boolean(usage, "stream_options.include_usage")
    every = opts.get("continuous_usage_stats")
    each = False if every is None else params.boolean(every, "stream_options.continuous_usage_stats")
    if each and not last:
        raise bad_request(
            "'stream_options.continuous_usage_stats' needs 'stream_options.include_usage': true",
            "stream_options.continuous_usage_stats",
        )
    return last, each


async def prompt_list(ctx: Context, prompt: object) -> list[tuple[list[int], str]]:
    """/v1/completions' `prompt`: a string or token ids, or a list of either; each prompt's ids
    and its text (what `echo` prepends)."""
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    items = prompt if many else [prompt]
    assert isinstance(items, list)
    if len(items) > MAX_CHOICES:
        raise bad_request(f"'prompt' holds {len(items)} prompts, more than {MAX_CHOICES}", "prompt")
    out = []
    for n, item in enumerate(items):
        where = f"prompt[{n}]" if many else "prompt"
        if isinstance(item, str):
            out.append((await ctx.encode(params.text(item, where), where), item))
        elif isinstance(item, list):
            ids = params.token_ids(item, where, ctx.info.vocab_size, ctx.info.max_context_tokens)
            out.append((ids, ctx.codec.decode(ids)))
        else:
            raise bad_request(f"'{where}' must be a string or a list of token ids, not {show(item)}", where)
    return out


def chat_messages(raw: object, features: frozenset[str]) -> list[dict[str, Any]]:
    """`messages` with string contents (text parts joined), as a chat template takes them; an
    assistant's `tool_calls` and a tool message's `tool_call_id` and `name` pass through as
    Hugging Face passes them, where the template renders tool calls (`features`), else a 400."""
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
        message: dict[str, Any] = {"role": role, "content": _content(msg.get("content"), where + ".content")}
        calls = msg.get("tool_calls")
        if calls is not None and calls != []:
            if "tool_calls" not in features:
                raise bad_request(
                    f"'{where}.tool_calls' cannot be rendered: this model's chat template has no tool calls",
                    where + ".tool_calls",
                )
            message["tool_calls"] = _tool_calls(calls, where + ".tool_calls")
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None:
                message[key] = params.text(msg[key], f"{where}.{key}", allow_empty=True)
        out.append(message)
    return out


def _tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"'{where}' must be a list of tool calls", where)
    for n, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            expected = "an object with 'function': {'name', 'arguments'}"
            raise bad_request(f"'{where}[{n}]' must be {expected}", where)
    return calls


def chat_tools(body: dict[str, Any], features: frozenset[str]) -> list[dict[str, Any]] | None:
    """`tools` as the chat template takes them (None: none given); a 400 where it cannot."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_request("'tools' must be a list of objects", "tools")
    if "tools" not in features:
        raise bad_request("'tools' cannot be rendered: this model's chat template takes no tools", "tools")
    return tools


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


async def parse(ctx: Context, body: dict[str, Any], tenant: str | None, *, chat: bool) -> Plan:
    """A request as the jobs of its choices, and how to answer for them."""
    check_model(ctx, body)
    known_keys.refuse_unknown(body, known_keys.CHAT if chat else known_keys.COMPLETIONS)
    # Chat's `echo` and completions' `top_logprobs` (its own is `logprobs`) are unknown keys there.
    params.refuse_unsupported(body, _UNSUPPORTED + known_keys.OPENAI_NEUTRAL)
    n = 1 if body.get("n") is None else params.integer(body.get("n"), "n", 1, MAX_N)
    if chat:
        features = ctx.chat_features()
        messages = chat_messages(body.get("messages"), features)
        prompts = [(await ctx.chat_prompt(messages, chat_tools(body, features)), "")]
    else:
        prompts = await prompt_list(ctx, body.get("prompt"))
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts times n={n} is over {MAX_CHOICES} choices", "n")
    s = params.sampling(
        body,
        max_keys=("max_completion_tokens", "max_tokens") if chat else ("max_tokens",),
        seed_keys=("seed",),
        vocab_size=ctx.info.vocab_size,
        max_context=ctx.info.max_context_tokens,
    )
    spec, logprobs = _logprobs(body, s.spec, chat)
    echo = not chat and body.get("echo") is not None and params.boolean(body.get("echo"), "echo")
    # With `echo`, the log-probabilities cover the prompt too, its first token's None (vLLM's).
    scored = echo and logprobs
    streaming = False if body.get("stream") is None else params.boolean(body.get("stream"), "stream")
    usage, usage_every_chunk = usage_options(body, streaming)
    # OpenAI's `user` names the end user: the conversation a session-affinity router keeps together.
    session = "" if body.get("user") is None else params.text(body.get("user"), "user", allow_empty=True)
    keep = False if body.get("no_stop_trim") is None else params.boolean(body["no_stop_trim"], "no_stop_trim")
    jobs, echoes, counts = [], [], []
    for input_ids, text in prompts:
        max_new = params.settle_max_new_tokens(
            len(input_ids),
            s.max_new_tokens,
            None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS,
            ctx.info.max_context_tokens,
            "messages" if chat else "prompt",
        )
        for j in range(n):
            # Choices of one prompt must differ: a client's seed gives the first, and seeds
            # derived from it the others (None: each from its own request id, at the node).
            seed = spec.seed if j == 0 or spec.seed is None else seed_for(f"{spec.seed}:{j}")
            choice = attrs.evolve(spec, seed=seed)
            if scored:
                choice = params.scoring_prompt_from(choice, 0, len(input_ids))
            req = GenerateRequest(ctx.new_rid(), input_ids, max_new, choice, tenant, session)
            api = "chat" if chat else "completions"
            jobs.append(Job(api, req, s.stop, no_stop_trim=keep, input_logprobs_from=0 if scored else -1))
            echoes.append(text if echo else "")
            counts.append(j == 0)
    return Plan(chat, jobs, echoes, counts, streaming, usage, logprobs, usage_every_chunk)


def _logprobs(body: dict[str, Any], spec: Sampling, chat: bool) -> tuple[Sampling, bool]:
    """Chat's `logprobs` (true/false) and `top_logprobs`, or completions' `logprobs` (how many
    alternatives: 0 gives the chosen token's alone), into `spec`."""
    if chat:
        asked = body.get("logprobs") is not None and params.boolean(body.get("logprobs"), "logprobs")
        top = body.get("top_logprobs")
        top = 0 if top is None else params.integer(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top and not asked:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        names = {"logprobs": "logprobs", "top_logprobs": "top_logprobs"}
    else:
        raw = body.get("logprobs")
        asked = raw is not None
        top = 0 if raw is None else params.integer(raw, "logprobs", 0, MAX_TOP_LOGPROBS)
        names = {"logprobs": "logprobs", "top_logprobs": "logprobs"}
    if not asked:
        return spec, False
    return params.with_logprobs(spec, True, top, names), True


def endpoint(chat: bool) -> Callable[[Request], Any]:
    async def handle(request: Request) -> Response:
        ctx = context(request)
        principal = ctx.auth.principal(request)
        body = await params.read_json(request, ctx.max_body_bytes)
        plan = await parse(ctx, body, principal.tenant, chat=chat)
        gens = [ctx.generation(request, job) for job in plan.jobs]
        shapes = Shapes(ctx, plan, gens)
        if plan.streaming:
            streams = await ctx.start_streams(request, gens)
            return gone() if streams is None else shapes.event_stream(streams, ctx.stream_stall_timeout_s)
        if not await ctx.run_all_to_end(request, gens):
            return gone()
        failed = next((gen for gen in gens if gen.failed), None)
        if failed is not None:
            raise failed.error()
        return JSON(shapes.whole())

    return generation_route("chat" if chat else "completions")(handle)


def _model_card(ctx: Context, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "hicache",
        "max_model_len": ctx.info.max_context_tokens,
    }


async def list_models(request: Request) -> Response:
    ctx = context(request)
    ctx.auth.principal(request)
    return JSON({"object": "list", "data": [_model_card(ctx, name) for name in ctx.model_names]})


async def get_model(request: Request) -> Response:
    ctx = context(request)
    ctx.auth.principal(request)
    name = request.path_params["model"]
    check_model(ctx, {"model": name})
    return JSON(_model_card(ctx, name))


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    Route("/v1/completions", endpoint(chat=False), methods=["POST"]),
    Route("/v1/chat/completions", endpoint(chat=True), methods=["POST"]),
]
