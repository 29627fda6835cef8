"""The runtime's control messages: length-checked frames of JSON, with an optional binary tail.

A frame is a fixed header — magic, version, JSON length, binary length — then the JSON object
and the binary bytes. A reader checks every length against its limits before it allocates, so a
peer that lies about a size or hangs up mid-frame yields a `ProtocolError`, never a large
allocation or a hang on a half-frame (the caller owns the timeout).

Clients talk to a decode node, and a decode node to its prefill node, with these frames; KV
itself moves over a transfer engine, never here (except the optional verification tail).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import trio

MAGIC = b"HCR1"
VERSION = 1
_HEAD = struct.Struct("<4sBIQ")  # magic, version, json length, binary length
MAX_JSON = 16 << 20
MAX_BINARY = 1 << 30
# At most this much is asked of the stream per read: a socket read allocates the size it asks
# for, so asking for a frame's announced length would allocate what a peer merely claims.
READ_CHUNK = 1 << 20


class ProtocolError(Exception):
    """A malformed, oversized or truncated frame, or a peer that went away mid-frame."""


def encode(obj: dict[str, Any], binary: bytes = b"") -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_JSON or len(binary) > MAX_BINARY:
        raise ProtocolError(f"frame too large: {len(body)} B of JSON, {len(binary)} B of binary")
    return _HEAD.pack(MAGIC, VERSION, len(body), len(binary)) + body + binary


async def send(stream: trio.abc.SendStream, obj: dict[str, Any], binary: bytes = b"") -> None:
    await stream.send_all(encode(obj, binary))


class FrameReader:
    """Reads frames from one stream, keeping what arrived past the current frame."""

    def __init__(
        self, stream: trio.abc.ReceiveStream, *, max_json: int = MAX_JSON, max_binary: int = MAX_BINARY
    ):
        self.stream = stream
        self.max_json = max_json
        self.max_binary = max_binary
        self._buf = bytearray()

    async def _exactly(self, n: int, what: str) -> bytes:
        while len(self._buf) < n:
            chunk = await self.stream.receive_some(min(max(65536, n - len(self._buf)), READ_CHUNK))
            if not chunk:
                if not self._buf and what == "header":
                    raise EOFError("the peer closed the connection")
                raise ProtocolError(f"the peer closed the connection inside a frame's {what}")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def receive(self) -> tuple[dict[str, Any], bytes]:
        """The next frame; `EOFError` at a clean end of stream between frames."""
        magic, version, n_json, n_bin = _HEAD.unpack(await self._exactly(_HEAD.size, "header"))
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise ProtocolError(f"frame version {version}, expected {VERSION}")
        if n_json > self.max_json:
            raise ProtocolError(f"frame announces {n_json} B of JSON, limit {self.max_json}")
        if n_bin > self.max_binary:
            raise ProtocolError(f"frame announces {n_bin} B of binary, limit {self.max_binary}")
        body = await self._exactly(n_json, "JSON")
        binary = await self._exactly(n_bin, "binary") if n_bin else b""
        try:
            obj = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"frame JSON does not parse: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
            raise ProtocolError("a frame's JSON must be an object with a string 'op'")
        return obj, binary


def field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """A message field of the expected type, or a `ProtocolError` naming it."""
    if name not in obj:
        raise ProtocolError(f"message {obj.get('op')!r}: missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ProtocolError(
            f"message {obj.get('op')!r}: field {name!r} has the wrong type ({type(value).__name__})"
        )
    return value


def int_list(obj: dict[str, Any], name: str, *, low: int = 0, high: int = 1 << 62) -> list[int]:
    values = field(obj, name, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) and low <= v < high for v in values):
        raise ProtocolError(
            f"message {obj.get('op')!r}: field {name!r} must hold integers in {low}..{high - 1}"
        )
    return values
