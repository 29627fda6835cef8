"""What a client may hold at the front door before its request reaches a route, and for how long.

Hypercorn closes a connection whose request line and headers do not arrive within its
keep-alive timeout (5 s) and refuses headers above 16 KiB (431); everything after the headers
is this module's, an ASGI middleware around the app:

- a request is authenticated from its headers alone, before a byte of its body is read: a
  wrong key is a 401 at once, whatever body follows (routes still check admin rights);
- at most `max_connections` requests are open at once (with HTTP/1.1 a connection carries one
  at a time, so this caps the connections that hold anything; one without a request is closed
  by Hypercorn's timeout): the next gets a 503 before its body is read. A tenant may hold at
  most `max_requests_per_tenant` of them (429), so no one caller fills the door or the queue;
- a body must arrive whole within `body_timeout_s` of its headers (408), may be at most
  `max_body_bytes` (413, counted as it arrives), and all the bodies held at once at most
  `body_bytes_in_flight` (503): a request's bytes count until it is answered.

`/health` and `/health_generate` pass untouched: a probe must never be refused by a crowd.
"""

from __future__ import annotations

import collections
import logging
import math

import attrs
import trio
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hicache.runtime.serving.auth import Auth
from hicache.runtime.serving.errors import ApiError, error_response

log = logging.getLogger("hicache.runtime.serving")

OPEN_PATHS = frozenset({"/health", "/health_generate"})
CALLER = "hicache.caller"  # the scope key naming who sent a request, for per-caller limits
DRAIN_BYTES = 1 << 20  # of a body past its limit, read and dropped so that the 413 is heard


def _positive(_: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:  # NaN too
        raise ValueError(f"door limits: {attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class DoorLimits:
    """The front door's bounds (README's serve section names the flags that set them)."""

    max_body_bytes: int = attrs.field(default=16 << 20, validator=_positive)
    body_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    body_bytes_in_flight: int = attrs.field(default=64 << 20, validator=_positive)
    max_connections: int = attrs.field(default=1024, validator=_positive)
    max_requests_per_tenant: int | None = None  # None: no cap of its own (the door's applies)


class BodyTooLarge(ApiError):
    def __init__(self, limit: int, declared: int | None = None) -> None:
        said = f"is {declared} bytes" if declared is not None else "is over the limit"
        super().__init__(413, f"the body {said}; the limit is {limit} bytes", code="body_too_large")


def busy(status: int, message: str, code: str, retry_after_s: int = 1) -> ApiError:
    """A refusal a client should retry later (503 for the server's limits, 429 for its own)."""
    err = ApiError(status, message, type="server_error" if status == 503 else "rate_limit_error", code=code)
    err.headers = {"Retry-After": str(retry_after_s)}
    return err


class Door:
    """The counts the middleware keeps: open requests, per tenant, and body bytes held."""

    def __init__(self, limits: DoorLimits) -> None:
        self.limits = limits
        self.open = 0
        self.by_tenant: collections.Counter[str] = collections.Counter()
        self.body_bytes = 0
        self.peak_body_bytes = 0
        self.refused: collections.Counter[str] = collections.Counter()  # by error code

    def admit(self, tenant: str) -> None:
        """Count a request in, or refuse it (503 at the door's cap, 429 at its tenant's)."""
        lim = self.limits
        if self.open >= lim.max_connections:
            raise busy(
                503,
                f"the server holds {self.open} requests, its most (--max-connections); retry later",
                "too_many_connections",
            )
        per = lim.max_requests_per_tenant
        if per is not None and self.by_tenant[tenant] >= per:
            raise busy(
                429,
                f"this caller already has {self.by_tenant[tenant]} requests open, its most "
                "(--max-requests-per-tenant); retry when one ends",
                "too_many_requests",
            )
        self.open += 1
        self.by_tenant[tenant] += 1

    def leave(self, tenant: str) -> None:
        self.open -= 1
        self.by_tenant[tenant] -= 1
        if not self.by_tenant[tenant]:
            del self.by_tenant[tenant]

    def take_body(self, n: int) -> None:
        cap = self.limits.body_bytes_in_flight
        if self.body_bytes + n > cap:
            raise busy(
                503,
                f"the server holds {self.body_bytes} bytes of request bodies, its most "
                "(--max-body-bytes-in-flight); retry later",
                "too_many_body_bytes",
            )
        self.body_bytes += n
        self.peak_body_bytes = max(self.peak_body_bytes, self.body_bytes)

    def give_body(self, n: int) -> None:
        self.body_bytes -= n


class BodyReader:
    """One request's `receive`: body bytes counted as they come, against the request's limit
    and the door's budget, within the body deadline; what follows the body (a disconnect)
    passes as it is. A refusal is raised out of `receive`, so a route reading the body answers
    it as it answers any `ApiError`."""

    def __init__(self, door: Door, receive: Receive, declared: int | None) -> None:
        self.door = door
        self._receive = receive
        self.declared = declared
        self.held = 0  # bytes charged to the door's budget
        self.done = declared == 0
        self.deadline = trio.current_time() + door.limits.body_timeout_s

    async def __call__(self) -> Message:
        if self.done:
            return await self._receive()
        lim = self.door.limits
        with trio.move_on_at(self.deadline) as late:
            message = await self._receive()
        if late.cancelled_caught:
            self.done = True
            raise ApiError(
                408,
                f"the body did not arrive within {lim.body_timeout_s:g} s (--body-timeout)",
                code="body_timeout",
            )
        if message["type"] != "http.request":
            self.done = True
            return message
        body = message.get("body", b"")
        if self.held + len(body) > lim.max_body_bytes:
            self.done = True
            if message.get("more_body", False):
                await self._drain()
            raise BodyTooLarge(lim.max_body_bytes)
        self.door.take_body(len(body))
        self.held += len(body)
        if not message.get("more_body", False):
            self.done = True
        return message

    async def _drain(self) -> None:
        """Read and drop up to `DRAIN_BYTES` more (held nowhere), within the deadline: a client
        still sending when the 413 goes out would meet a closed connection instead of it."""
        dropped = 0
        with trio.move_on_at(self.deadline):
            while dropped <= DRAIN_BYTES:
                message = await self._receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                dropped += len(message.get("body", b""))

    def release(self) -> None:
        self.door.give_body(self.held)
        self.held = 0


def _declared(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


class DoorMiddleware:
    """The ASGI middleware that applies `Door`'s counts (module notes)."""

    def __init__(self, app: ASGIApp, door: Door, auth: Auth) -> None:
        self.app = app
        self.door = door
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            tenant = self._caller(scope)
            declared = _declared(scope)
            if declared is not None and declared > self.door.limits.max_body_bytes:
                raise BodyTooLarge(self.door.limits.max_body_bytes, declared)
            self.door.admit(tenant)
        except ApiError as err:
            self.door.refused[err.code or str(err.status)] += 1
            log.warning(
                "%s %s refused with %d: %s", scope.get("method"), scope.get("path"), err.status, err.message
            )
            await error_response(err)(scope, receive, send)
            return
        scope[CALLER] = tenant
        body = BodyReader(self.door, receive, declared)
        try:
            await self.app(scope, body, send)
        finally:
            body.release()
            self.door.leave(tenant)

    def _caller(self, scope: Scope) -> str:
        """Who sends this request, from its headers (a 401 for a missing or unknown key)."""
        request = Request(scope)
        principal = self.auth.principal(request)  # raises the 401 before any body is read
        if self.auth.enabled:
            return f"tenant:{principal.tenant}"
        return self.auth.caller(request)


def retry_after(seconds: float) -> int:
    return max(1, min(60, math.ceil(seconds)))
