"""What every route shares: the backend, the codec, metrics, keys, and the steps that both
APIs take the same way (tokenizing off the event loop, counting refusals, running a
generation to its end or to its first token while watching for the client leaving)."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio
from starlette.requests import Request
from starlette.responses import Response

from hicache.runtime.serving.admission import Admission, Overloaded
from hicache.runtime.serving.auth import Auth
from hicache.runtime.serving.backend import Backend, ModelInfo, TextCodec
from hicache.runtime.serving.door import CALLER, Door, DoorLimits
from hicache.runtime.serving.errors import ApiError, bad_request, error_response
from hicache.runtime.serving.generation import Generation, Job, aclose_shielded
from hicache.runtime.serving.health import Health
from hicache.runtime.serving.metrics import Metrics
from hicache.runtime.serving.shutdown import Shutdown
from hicache.runtime.serving.sse import Disconnected, EventStream, until_disconnect
from hicache.runtime.serving.token_rate import TokenRate
from hicache.runtime.serving.trace_recorder import TraceRecorder

log = logging.getLogger("hicache.runtime.serving")

THREAD_ENCODE_CHARS = 32_768  # longer texts are tokenized in a worker thread, off the event loop
TOKENIZE_THREADS = 2  # texts tokenized at once in worker threads; more wait their turn


def can_fit(codec: TextCodec, chars: int, max_context: int, param: str) -> None:
    """Refuse, before tokenizing it, a text too long to fit the context whatever its tokens: a
    codec's `max_token_chars` (the most characters one of its tokens spells) makes
    `chars / max_token_chars` a floor on the tokens of `chars` characters. A codec that cannot
    say (a normalizer may shrink text) is not checked here; the body limit bounds it."""
    per = getattr(codec, "max_token_chars", None)
    if not isinstance(per, int) or per < 1:
        return
    if -(-chars // per) >= max_context:  # at least this many tokens: no room left to generate
        raise bad_request(
            f"'{param}' holds {chars} characters: at least {-(-chars // per)} tokens, as one token of "
            f"this model spells at most {per}; this node holds at most {max_context} tokens "
            "(prompt and output), so it has no room to generate",
            param,
        )


@attrs.define
class Context:
    backend: Backend
    codec: TextCodec
    model_name: str
    info: ModelInfo
    auth: Auth
    metrics: Metrics
    max_body_bytes: int
    started_at: float
    recorder: TraceRecorder
    admission: Admission | None = None  # the bounded queue in front of the backend; None: none
    health: Health = attrs.field(factory=Health)
    shutdown: Shutdown = attrs.field(factory=Shutdown)  # ends what is in flight when the server stops
    door: Door = attrs.field(factory=lambda: Door(DoorLimits()))  # what clients hold (door.py)
    stream_stall_timeout_s: float | None = None  # a stream not read for this long is aborted
    rate: TokenRate | None = None  # each caller's tokens per minute (token_rate.py); None: no limit
    tokenizing: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(TOKENIZE_THREADS))
    aliases: tuple[str, ...] = ()  # more names clients may call the model by (--served-model-name)
    page_size: int = 1  # tokens per KV page at the decode nodes (SGLang's server_info reports it)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model answers to, the one responses carry first."""
        return (self.model_name, *(a for a in self.aliases if a != self.model_name))

    async def _off_loop(self, fn: Callable[[], Any]) -> Any:
        """`fn()` in a worker thread, at most TOKENIZE_THREADS at once; a request cancelled
        meanwhile (its client left, the server stops) does not wait for it."""
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True, limiter=self.tokenizing)

    async def encode(self, text: str, param: str = "text") -> list[int]:
        can_fit(self.codec, len(text), self.info.max_context_tokens, param)
        if len(text) > THREAD_ENCODE_CHARS:
            return await self._off_loop(functools.partial(self.codec.encode, text))
        return self.codec.encode(text)

    def chat_features(self) -> frozenset[str]:
        """What the chat template renders beyond roles and contents ("tools", "tool_calls")."""
        return frozenset(getattr(self.codec, "chat_features", ()))

    async def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt's token ids (`tools` passed to the template only when given, as Hugging
        Face passes them)."""
        chars = sum(len(m.get("content") or "") for m in messages)
        can_fit(self.codec, chars, self.info.max_context_tokens, "messages")
        extra = {} if tools is None else {"tools": tools}
        apply = functools.partial(
            self.codec.apply_chat_template, messages, add_generation_prompt=True, **extra
        )
        try:
            out = await self._off_loop(apply) if chars > THREAD_ENCODE_CHARS else apply()
        except Exception as exc:  # a template that refuses these messages (jinja2's raise_exception)
            raise bad_request(f"the chat template refused the messages: {exc}"[:300], "messages") from None
        return await self.encode(out, "messages") if isinstance(out, str) else list(out)

    def event_stream(self, gen: Generation, body: AsyncGenerator[bytes, None]) -> EventStream:
        """The stream of `gen`'s events, stopped if its client stops reading (sse.py)."""
        return EventStream(body, stall_s=self.stream_stall_timeout_s, on_stall=gen.abort)

    def generation(self, request: Request, job: Job) -> Generation:
        arrived = getattr(request.state, "arrived", None)
        rec = self.recorder.active  # a request belongs to the recording running when it came
        on_end = None if rec is None else rec.record
        gen = Generation(
            self.backend,
            self.codec,
            self.metrics,
            job,
            self.info.eos_token_ids,
            arrived,
            on_end,
            admission=self.admission,
            rate=self.rate,
            caller=request.scope.get(CALLER, job.request.tenant or ""),
        )
        if rec is not None:
            rec.arrived(gen)  # the requests in flight when it came: the clients' concurrency
        return gen

    async def run_to_end(self, request: Request, gen: Generation) -> bool:
        """Run a non-streaming generation; False if the client left (the backend is aborted)."""
        return await self.run_all_to_end(request, [gen])

    async def run_all_to_end(self, request: Request, gens: Sequence[Generation]) -> bool:
        """Run non-streaming generations side by side (one request's choices); False if the
        client left (every backend request is aborted)."""

        async def drain(gen: Generation) -> None:
            async for _ in gen.run():
                pass

        async def drain_all() -> None:
            await _together([functools.partial(drain, gen) for gen in gens])

        with contextlib.ExitStack() as guards:
            # Each `gen` then ends as an abort, answered as one.
            scopes = [guards.enter_context(self.shutdown.guard(gen)) for gen in gens]
            try:
                await until_disconnect(request, drain_all)
            except Disconnected:
                return any(s.cancel_called for s in scopes)  # cut short by the server stopping
        return True

    async def start_stream(self, request: Request, gen: Generation) -> Stream | None:
        """Start a streaming generation and wait for its first text (or its end) while watching
        the client: a request that fails before its first token still gets an error status (503,
        or 400 when the node refused it as it is), not a 200 stream holding an error. None if
        the client left."""
        streams = await self.start_streams(request, [gen])
        return None if streams is None else streams[0]

    async def start_streams(self, request: Request, gens: Sequence[Generation]) -> list[Stream] | None:
        """`start_stream` for generations side by side (one request's choices): each has its
        first text or has ended; any failed before its first token is that error for them all."""
        tails = [gen.run() for gen in gens]
        heads: list[str | None] = [None] * len(gens)

        async def first(i: int) -> None:
            heads[i] = await anext(tails[i], None)

        async def all_first() -> None:
            await _together([functools.partial(first, i) for i in range(len(gens))])

        try:
            with contextlib.ExitStack() as guards:
                scopes = [guards.enter_context(self.shutdown.guard(gen)) for gen in gens]
                try:
                    await until_disconnect(request, all_first)
                except Disconnected:
                    if not any(s.cancel_called for s in scopes):  # the server stopping: an abort
                        raise
        except BaseException:
            for tail in tails:
                await aclose_shielded(tail)
            if isinstance(sys.exception(), Disconnected):
                return None
            raise
        for gen, head in zip(gens, heads, strict=True):
            if head is None and gen.failed and not gen.output_ids:
                for tail in tails:
                    await aclose_shielded(tail)
                raise gen.error()
        return [
            Stream([] if head is None else [head], tail, gen, self.shutdown)
            for gen, head, tail in zip(gens, heads, tails, strict=True)
        ]

    def new_rid(self) -> str:
        return uuid.uuid4().hex


@attrs.frozen
class Stream:
    """A started stream: the text pieces already taken (`head`), then the rest (`tail`)."""

    head: list[str]
    tail: AsyncGenerator[str, None]
    gen: Generation | None = None
    shutdown: Shutdown | None = None

    async def pieces(self) -> AsyncGenerator[str, None]:
        """The pieces, until the generation ends or the server stops (then it has ended as an
        abort, which the route's stream reports)."""
        try:
            for piece in self.head:
                yield piece
            while True:
                piece = None
                if self.shutdown is None or self.gen is None:
                    piece = await anext(self.tail, None)
                else:
                    with self.shutdown.guard(self.gen):  # never across a yield
                        piece = await anext(self.tail, None)
                if piece is None:
                    return
                yield piece
        finally:
            await aclose_shielded(self.tail)


Piece = tuple[int, str | None]  # a stream's index among its request's and its next text (None: it ended)


def interleave(
    streams: Sequence[Stream],
) -> tuple[trio.MemoryReceiveChannel[Piece], list[Callable[[], Awaitable[None]]]]:
    """Where one response's body reads several streams' pieces as they come (OpenAI's choices,
    SGLang's batch), and the producers (one per stream) that `EventStream` runs to feed it."""
    send, receive = trio.open_memory_channel[Piece](0)
    producers = [functools.partial(_feed, i, s, send.clone()) for i, s in enumerate(streams)]
    send.close()
    return receive, producers


async def _feed(i: int, stream: Stream, send: trio.MemorySendChannel[Piece]) -> None:
    """Stream `i`'s pieces into `send`, then (i, None) once it ended."""
    async with send:
        pieces = stream.pieces()
        try:
            async for piece in pieces:
                await send.send((i, piece))
        finally:
            await aclose_shielded(pieces)
        await send.send((i, None))


async def _together(fns: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Run `fns` side by side (one alone: in this task); a refusal (`ApiError`, such as a full
    queue's 503) out of any comes out as itself, not inside an exception group."""
    if len(fns) == 1:
        await fns[0]()
        return
    try:
        async with trio.open_nursery() as nursery:
            for fn in fns:
                nursery.start_soon(fn)
    except BaseExceptionGroup as group:
        refusal = _first_refusal(group)
        if refusal is not None:
            raise refusal from None
        raise


def _first_refusal(group: BaseExceptionGroup) -> ApiError | None:
    for exc in group.exceptions:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_refusal(exc)
            if found is not None:
                return found
    return None


def context(request: Request) -> Context:
    return request.app.state.ctx


def generation_route(api: str) -> Callable[[Callable[[Request], Awaitable[Response]]], Any]:
    """Counts and logs a generation request refused before it reached the backend (a 4xx);
    those that reach it are counted by `Generation` itself."""

    def wrap(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(endpoint)
        async def route(request: Request) -> Response:
            request.state.arrived = time.monotonic()  # TTFT counts reading and tokenizing
            try:
                return await endpoint(request)
            except ApiError as err:
                if isinstance(err, Overloaded):
                    context(request).metrics.requests.labels(api, "overloaded").inc()
                    log.warning("%s %s refused with 503: %s", request.method, request.url.path, err.message)
                elif err.status < 500:
                    context(request).metrics.requests.labels(api, "rejected").inc()
                    log.warning(
                        "%s %s refused with %d: %s", request.method, request.url.path, err.status, err.message
                    )
                return error_response(err)

        return route

    return wrap


def gone() -> Response:
    """The answer to a client that already left; nobody reads it."""
    return Response(status_code=499)
