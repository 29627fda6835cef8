"""Server-sent events, and noticing that a client left.

Hypercorn tells an app that a client left only through an `http.disconnect` message on
`receive`, and never cancels the app by itself; Starlette's StreamingResponse listens for it
while streaming but leaves the body generator suspended, unclosed. Both gaps would leave the
backend generating for nobody, so a response here always closes its body, and waits that
happen before a response exists (a non-streaming answer, the first token) watch `receive`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from hicache.runtime.serving.errors import ApiError, dumps
from hicache.runtime.serving.generation import aclose_shielded

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode("ascii") + b"\n\n"


class EventStream(StreamingResponse):
    """text/event-stream whose body generator is closed however the response ends.

    `tasks` run beside the body while it streams (what feeds it, such as one producer per
    choice of a request): a body generator must not open a nursery of its own, since it yields.
    They are cancelled when the response ends, however it ends.

    With `stall_s`, a client that takes nothing for that long stops the stream: while a write
    waits on a client that does not read, no more of the body is asked for (the generation is
    no longer fed); once one has waited `stall_s`, `on_stall` is told why (the generation ends
    as an abort, with the reason in its log line) and the body is closed, which aborts the
    request at the backend and frees its slot. The write itself ends when the kernel resets the
    connection (server.py's TCP_USER_TIMEOUT)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        tasks: Sequence[Callable[[], Awaitable[None]]] = (),
        *,
        stall_s: float | None = None,
        on_stall: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(body, headers=HEADERS)
        self._body = body
        self._tasks = tuple(tasks)
        self._stall_s = stall_s
        self._on_stall = on_stall
        self._writing_since: float | None = None
        self.stalled = False

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            self._writing_since = trio.current_time()
            try:
                await send(message)
            finally:
                self._writing_since = None

        try:
            if not self._tasks and self._stall_s is None:
                await super().stream_response(send)
                return
            try:
                async with trio.open_nursery() as nursery:
                    for task in self._tasks:
                        nursery.start_soon(task)
                    if self._stall_s is not None:
                        nursery.start_soon(self._watch, self._stall_s)
                    await super().stream_response(send if self._stall_s is None else timed)
                    nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:  # the response's own error, as it would come alone
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise
        finally:
            await aclose_shielded(self._body)

    async def _watch(self, stall_s: float) -> None:
        while True:
            since = self._writing_since
            if since is not None and trio.current_time() - since >= stall_s:
                break
            await trio.sleep(
                stall_s / 4 if since is None else max(0.0, since + stall_s - trio.current_time())
            )
        self.stalled = True
        reason = f"the client read nothing for {stall_s:g} s (--stream-stall-timeout)"
        if self._on_stall is not None:
            self._on_stall(reason)
        await aclose_shielded(self._body)


class Disconnected(Exception):
    """The client closed its connection while the app was waiting for the backend."""


async def until_disconnect(request: Request, fn: Callable[[], Awaitable[T]]) -> T:
    """`await fn()`, cancelled if the client disconnects first; `Disconnected` if the client
    left at all, even just as `fn` finished (its `http.disconnect` is consumed here, so a
    stream started after it would never hear of it). A refusal (`ApiError`) out of `fn`, such
    as a full queue's 503, comes out as itself, not inside an exception group."""
    result: list[T] = []
    left = False
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal left
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        left = True
                        nursery.cancel_scope.cancel()
                        return

            async def work() -> None:
                result.append(await fn())
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(work)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], ApiError):
            raise group.exceptions[0] from None
        raise
    if left or not result:
        raise Disconnected
    return result[0]
