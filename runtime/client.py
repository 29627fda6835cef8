"""A client of a decode node: send requests, read results (and the verification payload)."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from hicache.runtime import protocol


class DecodeClient:
    """One connection; requests on it are answered in order (open several for concurrency)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.reader = protocol.FrameReader(stream)
        self.lock = trio.Lock()

    @classmethod
    async def connect(cls, host: str, port: int) -> DecodeClient:
        return cls(await trio.open_tcp_stream(host, port))

    async def call(self, msg: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        async with self.lock:
            await protocol.send(self.stream, msg)
            reply, binary = await self.reader.receive()
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
