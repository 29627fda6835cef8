"""A client of a decode node: send requests, read results (and the verification payload)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import trio

from hicache.runtime import protocol


class DecodeClient:
    """One connection; requests on it are answered in order (open several for concurrency).

    A decode node closes a connection that stays idle past its idle timeout, saying `goodbye`
    first; it read nothing after that, so a request that meets the goodbye (or a connection
    that refuses the request's bytes) is sent again, once, on a new connection."""

    def __init__(self, stream: trio.SocketStream, address: tuple[str, int] | None = None) -> None:
        self.stream = stream
        self.reader = protocol.FrameReader(stream)
        self.lock = trio.Lock()
        self.address = address

    @classmethod
    async def connect(cls, host: str, port: int) -> DecodeClient:
        return cls(await trio.open_tcp_stream(host, port), (host, port))

    async def _reconnect(self) -> None:
        host, port = self.address or self.stream.socket.getpeername()[:2]
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.stream.aclose()
        self.stream = await trio.open_tcp_stream(host, port)
        self.reader = protocol.FrameReader(self.stream)

    async def _exchange(self, frame: bytes) -> tuple[dict[str, Any], bytes] | None:
        """The node's answer to `frame`, or None when the node provably did not read it."""
        try:
            await self.stream.send_all(frame)
        except trio.BrokenResourceError:
            return None  # the node had closed: a frame it did not receive whole is never served
        reply, binary = await self.reader.receive()
        return None if reply["op"] == "goodbye" else (reply, binary)

    async def call(self, msg: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        frame = protocol.encode(msg)
        async with self.lock:
            got = await self._exchange(frame)
            if got is None:
                await self._reconnect()
                got = await self._exchange(frame)
            if got is None:
                raise protocol.ProtocolError("decode node: closed the connection twice before answering")
        reply, binary = got
        if reply["op"] == "error":
            raise protocol.ProtocolError(f"decode node: {reply.get('reason')}")
        return reply, binary

    async def generate(
        self, rid: str, tokens: list[int], max_new: int, *, verify: bool = False, tenant: str | None = None
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        msg: dict[str, Any] = {
            "op": "generate",
            "rid": rid,
            "tokens": tokens,
            "max_new": max_new,
            "verify": verify,
        }
        if tenant is not None:
            msg["tenant"] = tenant
        reply, binary = await self.call(msg)
        kv = np.frombuffer(binary, dtype=np.float64) if binary else None
        return reply, kv

    async def evict(self, l1: int = 1 << 40, l2: int = 0) -> None:
        await self.call({"op": "evict", "l1": l1, "l2": l2})

    async def idle(self) -> None:
        await self.call({"op": "idle"})

    async def stats(self) -> dict[str, Any]:
        return (await self.call({"op": "stats"}))[0]

    async def aclose(self) -> None:
        await self.stream.aclose()
