"""A prefill node and a decode service in one process over the TCP engine, and a client: the
harness of the runtime tests that inject faults or stall a transfer."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio

from hicache.core.config import DecodeConfig
from hicache.faults import FaultSpec
from hicache.runtime import protocol
from hicache.runtime.client import DecodeClient
from hicache.runtime.decode_node import DecodeService
from hicache.runtime.model import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.prefill_node import PrefillNode
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.transfer.tcp import TcpEngine
from hicache.runtime.verify import KVLedger

PAGE = 16


@attrs.frozen
class NodePair:
    service: DecodeService
    client: DecodeClient
    ledger: KVLedger
    prefill: PrefillNode


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
    config: dict[str, Any] | None = None,
) -> AsyncIterator[NodePair]:
    """`config` overrides fields of the decode node's `DecodeConfig`."""
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    core = small_core(storage=storage, transfer_retries=retries)
    core = attrs.evolve(core, **(config or {}))
    spec = FaultSpec.parse(faults) if faults is not None else None
    async with (
        TcpEngine(name="prefill") as p_engine,
        decode_engine() as d_engine,
        trio.open_nursery() as nursery,
    ):
        prefill = PrefillNode(model, layout, p_engine, staging_pages=64)
        listeners = await nursery.start(prefill.serve, 0)
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
            yield NodePair(service, client, KVLedger(model, PAGE), prefill)
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


async def exchange(port: int, data: bytes, *, close: bool = True) -> list[dict[str, Any]]:
    """Send raw bytes, half-close (unless `close` is False), and read every reply until the
    node hangs up."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    replies = []
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(data)
            if close:
                await stream.send_eof()
        reader = protocol.FrameReader(stream, max_binary=0)
        with trio.fail_after(GUARD_S):
            while True:
                try:
                    reply, _ = await reader.receive()
                except (EOFError, trio.BrokenResourceError, protocol.ProtocolError):
                    break
                replies.append(reply)
    return replies
