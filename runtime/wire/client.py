"""A client of a decode node: send requests, read results (and the verification payload)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import trio

from hicache.runtime.wire import protocol


class NodeGone(protocol.ProtocolError):
    """The decode node closed the connection without answering: it stopped, crashed or was
    restarted, and the request's outcome is unknown (it may have been served)."""


class DecodeClient:
    """One connection; requests on it are answered in order (open several for concurrency).

    A decode node closes a connection that stays idle past its idle timeout, saying `goodbye`
    first; it read nothing after that, so a request that meets the goodbye (or a connection
    that refuses the request's bytes) is sent again, once, on a new connection. A node that
    goes away after reading a request is a `NodeGone` naming the node and the request. With an
    `api_key`, each connection authenticates first (a node with `--api-keys` needs it)."""

    def __init__(
        self,
        stream: trio.SocketStream,
        address: tuple[str, int] | None = None,
        *,
        api_key: str | None = None,
    ) -> None:
        self.stream = stream
        self.reader = protocol.FrameReader(stream)
        # Not a trio.Lock: a streaming generation may be closed by another task than its reader.
        self.lock = trio.Semaphore(1)
        self.address = address
        self.api_key = api_key
        self.principal: dict[str, Any] | None = None  # the node's answer to `auth`
        self._gone = False

    @classmethod
    async def connect(cls, host: str, port: int, *, api_key: str | None = None) -> DecodeClient:
        client = cls(await trio.open_tcp_stream(host, port), (host, port), api_key=api_key)
        if api_key is not None:
            async with client.lock:
                await client._authenticate()
        return client

    @property
    def where(self) -> str:
        if self.address is not None:
            return f"{self.address[0]}:{self.address[1]}"
        with contextlib.suppress(OSError):
            host, port = self.stream.socket.getpeername()[:2]
            return f"{host}:{port}"
        return "?"

    async def _authenticate(self) -> None:
        got = await self._exchange(protocol.encode({"op": "auth", "api_key": self.api_key}), "auth")
        if got is None or got[0]["op"] != "auth":
            reason = got[0].get("reason") if got is not None else "the connection closed"
            # The node says why: an unknown key, or a connection it could not take at all.
            raise protocol.ProtocolError(f"decode node at {self.where} refused the connection: {reason}")
        self.principal = got[0]

    async def _reconnect(self) -> None:
        host, port = self.address or self.stream.socket.getpeername()[:2]
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.stream.aclose()
        self.stream = await trio.open_tcp_stream(host, port)
        self.reader = protocol.FrameReader(self.stream)
        self._gone = False
        if self.api_key is not None:
            await self._authenticate()

    async def _exchange(self, frame: bytes, what: str) -> tuple[dict[str, Any], bytes] | None:
        """The node's answer to `frame`, or None when the node provably did not read it."""
        try:
            await self.stream.send_all(frame)
        except trio.BrokenResourceError:
            return None  # the node had closed: a frame it did not receive whole is never served
        reply, binary = await self._receive(what)  # a NodeGone: the next call reconnects first
        return None if reply["op"] == "goodbye" else (reply, binary)

    @property
    def usable(self) -> bool:
        """Whether the next request can go out on this connection without opening another."""
        return not self._gone

    async def _first_reply(self, frame: bytes, what: str) -> tuple[dict[str, Any], bytes]:
        """Send `frame` and return the node's first answer to it (call under `self.lock`); a
        node that provably did not read it gets it once more, on a new connection."""
        got = None if self._gone else await self._exchange(frame, what)
        if got is None:
            try:
                await self._reconnect()
            except OSError as exc:
                raise NodeGone(
                    f"decode node at {self.where} is gone: it closed the connection and refuses "
                    f"new ones ({exc.strerror or exc}); {what} was not sent"
                ) from None
            got = await self._exchange(frame, what)
        if got is None:
            raise protocol.ProtocolError(
                f"decode node at {self.where}: closed the connection twice before {what} was read"
            )
        return got

    def _refused(self, reply: dict[str, Any]) -> None:
        if reply["op"] == "error":
            raise protocol.ProtocolError(f"decode node at {self.where}: {reply.get('reason')}")

    async def call(self, msg: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        frame = protocol.encode(msg)
        rid = msg.get("rid")
        what = f"request {rid!r}" if isinstance(rid, str) else f"{msg.get('op')!r}"
        async with self.lock:
            reply, binary = await self._first_reply(frame, what)
        self._refused(reply)
        return reply, binary

    @staticmethod
    def _generate_msg(rid: str, tokens: list[int], max_new: int, tenant: str | None, **extra: Any) -> dict:
        msg: dict[str, Any] = {"op": "generate", "rid": rid, "tokens": tokens, "max_new": max_new, **extra}
        if tenant is not None:
            msg["tenant"] = tenant
        return msg

    async def generate(
        self, rid: str, tokens: list[int], max_new: int, *, verify: bool = False, tenant: str | None = None
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        reply, binary = await self.call(self._generate_msg(rid, tokens, max_new, tenant, verify=verify))
        kv = np.frombuffer(binary, dtype=np.float64) if binary else None
        return reply, kv

    async def generate_stream(
        self,
        rid: str,
        tokens: list[int],
        max_new: int,
        *,
        sampling: dict[str, Any] | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """A generation whose tokens come as they are made: yields each `tokens` frame, then the
        `result`. Leaving the iteration early (or being cancelled) aborts the request at the
        node and closes this connection (its reply would arrive out of turn)."""
        extra: dict[str, Any] = {"stream": True}
        if sampling is not None:
            extra["sampling"] = sampling
        frame = protocol.encode(self._generate_msg(rid, tokens, max_new, tenant, **extra))
        what = f"request {rid!r}"
        async with self.lock:
            done = False
            try:
                reply, _ = await self._first_reply(frame, what)
                while True:
                    self._refused(reply)
                    done = reply["op"] == "result"
                    yield reply
                    if done:
                        return
                    reply, _ = await self._receive(what)
            finally:
                if not done:
                    with (
                        trio.CancelScope(shield=True),
                        trio.move_on_after(2),
                        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
                    ):
                        await self.stream.send_all(protocol.encode({"op": "abort", "rid": rid}))
                    self._gone = True  # its result may still come: this connection is done
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await self.stream.aclose()

    async def _receive(self, what: str) -> tuple[dict[str, Any], bytes]:
        try:
            return await self.reader.receive()
        except (EOFError, trio.BrokenResourceError) as exc:
            self._gone = True
            raise NodeGone(
                f"decode node at {self.where} closed the connection without answering {what} "
                f"(it stopped or restarted; the outcome is unknown): {exc or type(exc).__name__}"
            ) from None

    async def peek(self, tokens: list[int], tenant: str | None = None) -> int:
        """Pages of `tokens` the node holds in L1 or L2 (for the tenant), counting no access."""
        msg: dict[str, Any] = {"op": "peek", "tokens": tokens}
        if tenant is not None:
            msg["tenant"] = tenant
        return int((await self.call(msg))[0]["pages"])

    async def evict(self, l1: int = 1 << 40, l2: int = 0) -> None:
        await self.call({"op": "evict", "l1": l1, "l2": l2})

    async def idle(self) -> None:
        await self.call({"op": "idle"})

    async def stats(self) -> dict[str, Any]:
        return (await self.call({"op": "stats"}))[0]

    async def config(self) -> dict[str, Any]:
        """The node's settings (admin): `model`, `config` (its `DecodeConfig`), `layout`, `storage`."""
        reply = (await self.call({"op": "config"}))[0]
        return {k: v for k, v in reply.items() if k != "op"}

    async def aclose(self) -> None:
        await self.stream.aclose()
