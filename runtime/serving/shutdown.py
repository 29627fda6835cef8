"""Ending the generations in flight when the front door stops, so each response says why.

Without this a SIGTERM cancelled the server under its streams: a client saw its connection end
with no error event and no finish reason, as if the answer were complete. `Shutdown.begin`
finishes every generation in flight as an abort with a reason and cancels only the wait for its
next piece, so its route ends the response the way it ends any failed generation (an error
object and `[DONE]` in an OpenAI stream, a `finish_reason` of type abort in SGLang's, a 503
before the first token or for a whole answer). The server then closes the connections once
their responses are out (Hypercorn's graceful shutdown, `server.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

from hicache.runtime.serving.generation import Generation

SHUTDOWN_MESSAGE = "the server is shutting down"


class Shutdown:
    """The waits of the generations in flight, and whether the server is stopping."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._waits: dict[trio.CancelScope, Generation] = {}

    def begin(self, reason: str = SHUTDOWN_MESSAGE) -> None:
        """End every generation in flight, and each that starts a wait from now on."""
        if self.reason is None:
            self.reason = reason
        for scope, gen in list(self._waits.items()):
            gen.abort(self.reason)
            scope.cancel()

    @contextlib.contextmanager
    def guard(self, gen: Generation) -> Iterator[trio.CancelScope]:
        """A wait of `gen` on its backend that `begin` cuts short (the scope says if it did)."""
        with trio.CancelScope() as scope:
            self._waits[scope] = gen
            try:
                if self.reason is not None:
                    gen.abort(self.reason)
                    scope.cancel()
                yield scope
            finally:
                del self._waits[scope]
