"""A prefill node and a decode service in one process over the TCP engine, and a client: the
harness of the runtime tests that inject faults or stall a transfer."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio

from hicache.core.config import DecodeConfig
from hicache.faults import FaultSpec
from hicache.runtime.decode.decode_node import DecodeService
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.prefill.prefill_node import PrefillNode
from hicache.runtime.security import peer_auth
from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.transfer.tcp import TcpEngine
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire import protocol
from hicache.runtime.wire.client import DecodeClient

PAGE = 16


@attrs.frozen
class NodePair:
    service: DecodeService
    client: DecodeClient
    ledger: KVLedger
    prefill: PrefillNode
    prefill_port: int


GUARD_S = 20  # a guard against hangs, never a speed assertion


def small_core(**kw: Any) -> DecodeConfig:
    """The decode node's core in these tests: small tiers of 64 pages, L3 prefetched from one
    page on, two pages reserved for decoding; keywords override any field."""
    base: dict[str, Any] = dict(
        l1_pages=64,
        l2_pages=64,
        page_size=PAGE,
        prefetch_threshold_tokens=PAGE,
        decode_reserve_tokens=2 * PAGE,
    )
    return DecodeConfig(**{**base, **kw})


@asynccontextmanager
async def node_pair(
    tmp_path: Path,
    faults: dict[str, Any] | None = None,
    *,
    retries: int = 2,
    storage: bool = True,
    transfer_timeout: float = 30.0,
    fence_timeout: float = 5.0,
    decode_engine: Callable[[], TcpEngine] = lambda: TcpEngine(name="decode"),
    prefill_engine: Callable[[], TcpEngine] = lambda: TcpEngine(name="prefill"),
    config: dict[str, Any] | None = None,
    prefill: dict[str, Any] | None = None,
    prefill_model: TinyModel | None = None,
) -> AsyncIterator[NodePair]:
    """`config` overrides fields of the decode node's `DecodeConfig`; `prefill` passes keywords
    to the `PrefillNode`, which computes with `prefill_model` when given."""
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    core = small_core(storage=storage, transfer_retries=retries)
    core = attrs.evolve(core, **(config or {}))
    spec = FaultSpec.parse(faults) if faults is not None else None
    async with (
        prefill_engine() as p_engine,
        decode_engine() as d_engine,
        trio.open_nursery() as nursery,
    ):
        prefill_node = PrefillNode(
            prefill_model or model, layout, p_engine, **{"staging_pages": 64, **(prefill or {})}
        )
        listeners = await nursery.start(prefill_node.serve, 0)
        store = FileStore(tmp_path / "l3", layout)
        service = DecodeService(
            core,
            model,
            layout,
            store,
            d_engine,
            faults=spec,
            transfer_timeout=transfer_timeout,
            fence_timeout=fence_timeout,
        )
        prefill_at = ("127.0.0.1", listeners[0].socket.getsockname()[1])
        port = await nursery.start(service.run, 0, prefill_at)
        client = await DecodeClient.connect("127.0.0.1", port)
        try:
            yield NodePair(service, client, KVLedger(model, PAGE), prefill_node, prefill_at[1])
        finally:
            await client.aclose()
            nursery.cancel_scope.cancel()


async def turn(client: DecodeClient, ledger: KVLedger, rid: str, prompt: list[int]) -> dict[str, Any]:
    """One request, checked bit-exactly when it finishes; the node is at rest afterwards."""
    with trio.fail_after(60):
        reply, kv = await client.generate(rid, prompt, 3, verify=True)
        await client.idle()
    if reply["outcome"] == "finished":
        assert ledger.check(prompt, 3, reply, kv) == []
    return reply


async def assert_nothing_held(service: DecodeService, client: DecodeClient) -> None:
    await client.idle()
    audit = service.audit()
    assert audit["check"] == "ok"
    for key in ("l1_leaked", "l2_leaked", "locks", "pins", "live", "reserved"):
        assert audit[key] == 0, audit


def prompt(seed: int, n: int = 96) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


async def authenticated(
    port: int, secret: ClusterSecret | None
) -> tuple[trio.SocketStream, protocol.FrameReader]:
    """A connection to a node's control port, past the cluster-secret handshake when `secret`
    is given (a prefill node acts on nothing else before it)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    reader = protocol.FrameReader(stream, max_binary=0)
    if secret is not None:

        async def hear() -> dict[str, Any]:
            return (await reader.receive())[0]

        with trio.fail_after(GUARD_S):
            await peer_auth.initiate(secret, functools.partial(protocol.send, stream), hear, "the node")
    return stream, reader


async def stand_in_hello(stream: trio.SocketStream, reader: protocol.FrameReader) -> dict[str, Any]:
    """What a stand-in prefill node does first: the handshake as the acceptor (with the test
    run's cluster secret), then it reads the decode node's hello and returns it."""

    async def hear() -> dict[str, Any]:
        return (await reader.receive())[0]

    await peer_auth.accept(
        ClusterSecret.load(), functools.partial(protocol.send, stream), hear, "the decode node"
    )
    return await hear()


def authenticated_socket(port: int, secret: ClusterSecret) -> socket.socket:
    """`authenticated` for plain blocking sockets (a node running in another thread)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=GUARD_S)
    msg, expected = peer_auth.answer(secret, _read_frame(sock), "the node")
    sock.sendall(protocol.encode(msg))
    peer_auth.check_proof(expected, _read_frame(sock), "the node")
    return sock


def _read_frame(sock: socket.socket) -> dict[str, Any]:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise EOFError("the node closed the connection")
            out += chunk
        return out

    _, _, n_json, n_bin = struct.unpack("<4sBIQ", exactly(protocol.HEADER_SIZE))
    obj = json.loads(exactly(n_json))
    exactly(n_bin)
    return obj


async def exchange(
    port: int, data: bytes, *, close: bool = True, secret: ClusterSecret | None = None
) -> list[dict[str, Any]]:
    """Send raw bytes (after the handshake when `secret` is given), half-close (unless `close`
    is False), and read every reply until the node hangs up."""
    stream, reader = await authenticated(port, secret)
    replies = []
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(data)
            if close:
                await stream.send_eof()
        with trio.fail_after(GUARD_S):
            while True:
                try:
                    reply, _ = await reader.receive()
                except (EOFError, trio.BrokenResourceError, protocol.ProtocolError):
                    break
                replies.append(reply)
    return replies
