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
from hicache.runtime.serving.errors import ApiError, bad_request, error_response, unavailable
from hicache.runtime.serving.generation import Generation, Job, aclose_shielded
from hicache.runtime.serving.health import Health
from hicache.runtime.serving.metrics import Metrics
from hicache.runtime.serving.shutdown import Shutdown
from hicache.runtime.serving.sse import Disconnected, until_disconnect
from hicache.runtime.serving.trace_recorder import TraceRecorder

log = logging.getLogger("hicache.runtime.serving")

THREAD_ENCODE_CHARS = 32_768  # longer texts are tokenized in a worker thread, off the event loop


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
    aliases: tuple[str, ...] = ()  # more names clients may call the model by (--served-model-name)
    page_size: int = 1  # tokens per KV page at the decode nodes (SGLang's server_info reports it)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model answers to, the one responses carry first."""
        return (self.model_name, *(a for a in self.aliases if a != self.model_name))

    async def encode(self, text: str) -> list[int]:
        if len(text) > THREAD_ENCODE_CHARS:
            return await trio.to_thread.run_sync(self.codec.encode, text)
        return self.codec.encode(text)

    def chat_features(self) -> frozenset[str]:
        """What the chat template renders beyond roles and contents ("tools", "tool_calls")."""
        return frozenset(getattr(self.codec, "chat_features", ()))

    async def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt's token ids (`tools` passed to the template only when given, as Hugging
        Face passes them)."""
        extra = {} if tools is None else {"tools": tools}
        apply = functools.partial(
            self.codec.apply_chat_template, messages, add_generation_prompt=True, **extra
        )
        try:
            if sum(len(m["content"]) for m in messages) > THREAD_ENCODE_CHARS:
                out = await trio.to_thread.run_sync(apply)
            else:
                out = apply()
        except Exception as exc:  # a template that refuses these messages (jinja2's raise_exception)
            raise bad_request(f"the chat template refused the messages: {exc}"[:300], "messages") from None
        return await self.encode(out) if isinstance(out, str) else list(out)

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
        the client: a request refused before its first token still gets a 503 status, not a
        200 stream holding an error. None if the client left."""
        streams = await self.start_streams(request, [gen])
        return None if streams is None else streams[0]

    async def start_streams(self, request: Request, gens: Sequence[Generation]) -> list[Stream] | None:
        """`start_stream` for generations side by side (one request's choices): each has its
        first text or has ended; any refused before its first token is a 503 for them all."""
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
                assert gen.finish is not None
                message = gen.finish.message or "the backend refused the request"
                raise unavailable(message, code=gen.finish.reason)
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
