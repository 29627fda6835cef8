"""The runtime's control messages: length-checked frames of JSON, with an optional binary tail.

A frame is a fixed header — magic, version, JSON length, binary length — then the JSON object
and the binary bytes. A reader checks every length against its limits before it allocates, so a
peer that lies about a size or hangs up mid-frame yields a `ProtocolError`, never a large
allocation. Anything a peer can send ends as a `ProtocolError` (JSON nested too deep, numbers
with too many digits included), never another exception. Given the node's limits, a reader also
cuts off a frame that does not complete within `frame_timeout` of its first byte, a connection
silent for `idle_timeout` between frames (`IdleTimeout`), and a frame whose announced size the
node's budget of bytes in flight cannot take (`runtime/security/limits.py`).

Clients talk to a decode node, and a decode node to its prefill node, with these frames; KV
itself moves over a transfer engine, never here (except the optional verification tail).
"""

from __future__ import annotations

import json
import math
import reprlib
import struct
from typing import Any, Protocol

import trio

MAGIC = b"HCR1"
VERSION = 1
_HEAD = struct.Struct("<4sBIQ")  # magic, version, json length, binary length
HEADER_SIZE = _HEAD.size
MAX_JSON = 16 << 20
MAX_BINARY = 1 << 30
# At most this much is asked of the stream per read: a socket read allocates the size it asks
# for, so asking for a frame's announced length would allocate what a peer merely claims.
READ_CHUNK = 1 << 20

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 40
_SHOW.maxlist = _SHOW.maxdict = 4
_SHOW.maxlevel = 2


def clip(message: str, limit: int = 240) -> str:
    """A message cut to `limit` characters: an error may quote a peer's input."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


def show(value: Any) -> str:
    """A short repr for an error message or the log: a peer's value may be 16 MiB long."""
    try:
        return _SHOW.repr(value)
    except (RecursionError, ValueError):
        return f"<{type(value).__name__}>"


class ProtocolError(Exception):
    """A malformed, oversized or truncated frame, or a peer that went away mid-frame."""


class MessageError(ProtocolError):
    """A whole, well-formed frame whose message has a missing field or a bad value: the frame
    boundary is intact, so the request is answered with this and the connection goes on."""


class IdleTimeout(ProtocolError):
    """No byte of a next frame within the reader's idle timeout (nothing of it was read)."""


class FrameBudget(Protocol):
    """A node's budget of bytes for frames being received (`runtime/security/limits.py`'s `Gate`)."""

    @property
    def small(self) -> int: ...  # frames up to this size are not counted

    def take(self, n: int) -> str: ...  # reserve n bytes, or say why not

    def give(self, n: int) -> None: ...


def encode(obj: dict[str, Any], binary: bytes = b"") -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_JSON or len(binary) > MAX_BINARY:
        raise ProtocolError(f"frame too large: {len(body)} B of JSON, {len(binary)} B of binary")
    return _HEAD.pack(MAGIC, VERSION, len(body), len(binary)) + body + binary


async def send(stream: trio.abc.SendStream, obj: dict[str, Any], binary: bytes = b"") -> None:
    await stream.send_all(encode(obj, binary))


class FrameReader:
    """Reads frames from one stream, keeping what arrived past the current frame.

    `frame_timeout` runs from the first byte of a frame (or from the call, when bytes of it are
    already buffered) to its last; `idle_timeout` bounds the wait for a next frame's first byte;
    `budget` is charged a frame's announced size while it is received. None: no such bound."""

    def __init__(
        self,
        stream: trio.abc.ReceiveStream,
        *,
        max_json: int = MAX_JSON,
        max_binary: int = MAX_BINARY,
        frame_timeout: float | None = None,
        idle_timeout: float | None = None,
        budget: FrameBudget | None = None,
    ):
        self.stream = stream
        self.max_json = max_json
        self.max_binary = max_binary
        self.frame_timeout = math.inf if frame_timeout is None else frame_timeout
        self.idle_timeout = math.inf if idle_timeout is None else idle_timeout
        self.budget = budget
        self._buf = bytearray()
        self._peeked: tuple[dict[str, Any], bytes] | BaseException | None = None
        self._idle_wait: trio.CancelScope | None = None  # while waiting for a frame's first byte
        self._closed_because = ""

    async def _fill(self, n: int, what: str) -> None:
        """Buffer at least `n` bytes, consuming none: a read cancelled half-way (a request's
        watcher that stops when its answer is ready) leaves the frame whole for the next one."""
        while len(self._buf) < n:
            chunk = await self.stream.receive_some(min(max(65536, n - len(self._buf)), READ_CHUNK))
            if not chunk:
                if not self._buf and what == "header":
                    raise EOFError("the peer closed the connection")
                raise ProtocolError(f"the peer closed the connection inside a frame's {what}")
            self._buf += chunk

    @property
    def in_idle_wait(self) -> bool:
        """Waiting for a next frame of which no byte has arrived."""
        return self._idle_wait is not None and not self._buf

    def end_idle_wait(self, reason: str) -> bool:
        """End a wait for a next frame of which no byte has arrived, as its idle timeout would
        (an `IdleTimeout` saying `reason`); False, doing nothing, if the reader is not in one."""
        if not self.in_idle_wait:
            return False
        assert self._idle_wait is not None
        self._closed_because = reason
        self._idle_wait.cancel()
        return True

    async def peek(self) -> dict[str, Any]:
        """The next frame's JSON, left to be received (what `receive` would raise is raised
        now and again by `receive`, an idle timeout aside): a node watches a connection while
        it answers a request, and takes only an `abort` of it, leaving anything else to its
        turn."""
        if self._peeked is None:
            try:
                self._peeked = await self._receive()
            except IdleTimeout:
                raise  # nothing of a frame was read: nothing to keep
            except (ProtocolError, EOFError) as exc:
                self._peeked = exc
        if isinstance(self._peeked, BaseException):
            raise self._peeked
        return self._peeked[0]

    async def receive(self) -> tuple[dict[str, Any], bytes]:
        """The next frame; `EOFError` at a clean end of stream between frames."""
        peeked, self._peeked = self._peeked, None
        if isinstance(peeked, BaseException):
            raise peeked
        if peeked is not None:
            return peeked
        return await self._receive()

    async def _receive(self) -> tuple[dict[str, Any], bytes]:
        if not self._buf:
            with trio.move_on_after(self.idle_timeout) as idle:
                self._idle_wait = idle
                try:
                    chunk = await self.stream.receive_some(65536)
                finally:
                    self._idle_wait = None
            if idle.cancelled_caught:
                why = (
                    self._closed_because
                    or f"no frame within {self.idle_timeout:g} s: the connection was idle"
                )
                raise IdleTimeout(why)
            if not chunk:
                raise EOFError("the peer closed the connection")
            self._buf += chunk
        got: tuple[dict[str, Any], bytes] | None = None
        with trio.move_on_after(self.frame_timeout):
            got = await self._frame()
        if got is None:
            raise ProtocolError(f"a frame did not complete within {self.frame_timeout:g} s of its first byte")
        return got

    async def _frame(self) -> tuple[dict[str, Any], bytes]:
        await self._fill(_HEAD.size, "header")
        magic, version, n_json, n_bin = _HEAD.unpack(self._buf[: _HEAD.size])
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise ProtocolError(f"frame version {version}, expected {VERSION}")
        if n_json > self.max_json:
            raise ProtocolError(f"frame announces {n_json} B of JSON, limit {self.max_json}")
        if n_bin > self.max_binary:
            raise ProtocolError(f"frame announces {n_bin} B of binary, limit {self.max_binary}")
        size = n_json + n_bin
        budget = self.budget if self.budget is not None and size > self.budget.small else None
        if budget is not None and (why := budget.take(size)):
            raise ProtocolError(why)
        try:
            await self._fill(_HEAD.size + n_json, "JSON")
            await self._fill(_HEAD.size + size, "binary")
        finally:
            if budget is not None:
                budget.give(size)
        body = bytes(self._buf[_HEAD.size : _HEAD.size + n_json])
        binary = bytes(self._buf[_HEAD.size + n_json : _HEAD.size + size])
        del self._buf[: _HEAD.size + size]
        try:
            obj = json.loads(body)
        except RecursionError:
            raise ProtocolError("frame JSON is nested too deep") from None
        except ValueError as exc:  # bad UTF-8, bad JSON, an integer of more than 4,300 digits
            raise ProtocolError(f"frame JSON does not parse: {clip(str(exc))}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
            raise ProtocolError("a frame's JSON must be an object with a string 'op'")
        return obj, binary


def _op(obj: dict[str, Any]) -> str:
    return show(obj.get("op"))


def field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """A message field of the expected type, or a `MessageError` naming it."""
    if name not in obj:
        raise MessageError(f"message {_op(obj)}: missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        expected = " or ".join(k.__name__ for k in kinds)
        raise MessageError(
            f"message {_op(obj)}: field {name!r} has the wrong type ({type(value).__name__}), "
            f"expected {expected}"
        )
    return value


def int_field(obj: dict[str, Any], name: str, *, low: int = 0, high: int = 1 << 62) -> int:
    """An integer field in [low, high), or a `MessageError` naming it."""
    value = field(obj, name, int)
    if not low <= value < high:
        raise MessageError(
            f"message {_op(obj)}: field {name!r} must be in {low}..{high - 1}, got {show(value)}"
        )
    return value


def seconds(value: object) -> float | None:
    """A duration a peer reported: a finite number >= 0 as a float, else None (not an error:
    a peer's timing informs an account, it never decides anything)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def text(obj: dict[str, Any], name: str) -> str:
    """A string field that is valid Unicode text (no lone surrogates, which have no UTF-8)."""
    value = field(obj, name, str)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise MessageError(
            f"message {_op(obj)}: field {name!r} must be a string of Unicode text, got {show(value)} "
            "(a lone surrogate has no UTF-8 encoding)"
        ) from None
    return value


def int_list(obj: dict[str, Any], name: str, *, low: int = 0, high: int = 1 << 62) -> list[int]:
    values = field(obj, name, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) and low <= v < high for v in values):
        raise MessageError(f"message {_op(obj)}: field {name!r} must hold integers in {low}..{high - 1}")
    return values
