"""Fences: once a decode node gives up on a transfer, not another byte of it lands in L1.

Engine level: the TCP target cuts off a WRITE that is landing and refuses one that arrives after
the fence; `settle` returns only once the initiator moves nothing more. Node level: a prefill
that stalls makes the decode node time out; with a fencing engine it retries at once, with one
that cannot fence (one-sided writes) it asks prefill to cancel and confirm, and when prefill
cannot confirm the request fails while its pages stay claimed until the transfer settles.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
from engine_kinds import ENGINES
from node_pair import assert_nothing_held, node_pair, prompt, turn
from transfer_peer import read_reply, wire_initiate

from hicache.runtime.prefill.prefill_node import PrefillNode
from hicache.runtime.transfer import NixlEngine, PeerInfo, TcpEngine, TransferEngine, XferState
from hicache.runtime.transfer.tcp_wire import Msg, encode_header

PAGES, PAGE_BYTES = 8, 64 * 1024
GUARD_S = 20  # a guard against hangs, never a speed assertion


@contextlib.asynccontextmanager
async def tcp_target() -> AsyncIterator[tuple[TcpEngine, np.ndarray]]:
    pool = np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8)
    async with TcpEngine(name="target") as engine:
        engine.register("pool", pool)
        yield engine, pool


async def test_tcp_fence_cuts_off_a_write_that_is_landing() -> None:
    rng = np.random.default_rng(1)
    data = rng.integers(1, 256, (4, PAGE_BYTES), dtype=np.uint8)
    dst = [5, 1, 6, 2]
    async with tcp_target() as (engine, pool):
        # The target knows "prefill" (as its control connection would have introduced it).
        fields = {"host": b"127.0.0.1", "port": (9).to_bytes(2, "little")}
        await engine.add_peer(PeerInfo("tcp", "prefill", fields, ()).encode())
        stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
        with trio.fail_after(GUARD_S):
            await wire_initiate(stream, b"prefill")
            head = encode_header(Msg.WRITE, 1, b"pool", len(dst), PAGE_BYTES, len(b"kv:7"))
            await stream.send_all(head + struct.pack(f"<{len(dst)}I", *dst) + b"kv:7")
            # The first page and a half: the WRITE is landing when the target gives up on it.
            await stream.send_all(data[0].tobytes() + data[1, : PAGE_BYTES // 2].tobytes())
            while not (pool[5] == data[0]).all():
                await trio.sleep(0.005)
            assert await engine.fence(b"kv:7") is True
            after_fence = pool.copy()
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(data[1, PAGE_BYTES // 2 :].tobytes() + data[2:].tobytes())
            mtype, text = await read_reply(stream)
            await stream.aclose()
            await trio.sleep(0.05)
        assert engine.notifs() == []  # nobody is told the transfer arrived
    assert mtype == Msg.ERROR and b"fenced while landing" in text
    assert (pool == after_fence).all()  # not a byte after the fence
    assert not pool[[6, 2]].any()  # the pages it never reached are untouched


async def test_tcp_fence_refuses_a_write_that_comes_later_and_only_that_one() -> None:
    pa = torch.from_numpy(np.random.default_rng(2).integers(1, 256, (PAGES, PAGE_BYTES), dtype=np.uint8))
    async with tcp_target() as (b, pool), TcpEngine(name="a") as a:
        ra = a.register("pool", pa)
        await a.add_peer(b.local_info())
        await b.add_peer(a.local_info())
        assert await b.fence(b"kv:1") is True
        with trio.fail_after(GUARD_S):
            late = await a.post("WRITE", ra, [0, 1], "target", "pool", [0, 1], b"kv:1")
            assert await a.wait(late, timeout=GUARD_S) is XferState.ERR
            assert "fenced" in (a.reason(late) or "")
            a.release(late)
            assert not pool.any() and b.notifs() == []
            other = await a.post("WRITE", ra, [2, 3], "target", "pool", [2, 3], b"kv:2")
            assert await a.wait(other, timeout=GUARD_S) is XferState.DONE
            a.release(other)
            await trio.sleep(0.05)
        assert b.notifs() == [("a", b"kv:2")]
    assert (pool[2:4] == pa[2:4].numpy()).all() and not pool[:2].any()


@pytest.mark.parametrize("kind", ENGINES)
async def test_settle_returns_once_the_initiator_moves_nothing_more(kind: str) -> None:
    def make(name: str) -> TransferEngine:
        return TcpEngine(name=name) if kind == "tcp" else NixlEngine(name)

    pa = torch.ones((PAGES, PAGE_BYTES), dtype=torch.uint8)
    pb = torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8)
    async with make("a") as a, make("b") as b:
        ra = a.register("pool", pa)
        b.register("pool", pb)
        await a.add_peer(b.local_info())
        await b.add_peer(a.local_info())
        with trio.fail_after(GUARD_S):
            for _ in range(3):
                handle = await a.post("WRITE", ra, range(PAGES), "b", "pool", range(PAGES), b"x")
                await a.settle(handle)
                with pytest.raises(ValueError, match="unknown or already released"):
                    a.state(handle)
            done = await a.post("WRITE", ra, [0], "b", "pool", [0], b"y")
            assert await a.wait(done, timeout=GUARD_S) is XferState.DONE
            await a.settle(done)
        # A target reading every byte itself can fence; one-sided writes cannot be refused.
        assert await b.fence(b"z") is (kind == "tcp")


# ---------------------------------------------------------------------------------------------
# A decode node giving up on a stalled transfer


class UnfencedTcpEngine(TcpEngine):
    """A TCP engine whose target side cannot fence, like a one-sided (RDMA) engine: the decode
    node must rely on prefill settling the WRITE."""

    async def fence(self, notif: bytes) -> bool:
        await trio.lowlevel.checkpoint()
        return False


def stall_first(prefill: PrefillNode, name: str, gate: trio.Event | None = None) -> list[int]:
    """Make the first call of `prefill.<name>` hang until cancelled (or until `gate` is set);
    returns a list that counts the calls."""
    original: Callable[..., Awaitable[Any]] = getattr(prefill, name)
    calls: list[int] = []

    async def stalled(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            if gate is None:
                await trio.sleep_forever()
            await gate.wait()
        return await original(*args)

    setattr(prefill, name, stalled)
    return calls


@pytest.mark.slow
async def test_a_stalled_transfer_is_cancelled_on_prefill_and_retried(tmp_path: Path) -> None:
    """Prefill silent about a transfer: the decode node gives it up, and, though its TCP target
    could fence it alone, asks prefill to cancel it first, so prefill drops that work instead
    of computing it for nobody beside the retry."""
    async with node_pair(tmp_path, transfer_timeout=0.5) as pair:
        answers = stall_first(pair.prefill, "_answer_kv")
        reply = await turn(pair.client, pair.ledger, "a", prompt(1))
        assert reply["outcome"] == "finished", reply["reason"]
        assert len(answers) == 2 and pair.prefill.cancelled == 1
        assert pair.service.transfers.cancels == 1  # prefill confirmed: that is the fence
        stats = await pair.client.stats()
        assert stats["transfer_retries"] == 1 and stats["transfers_abandoned"] == 0
        await assert_nothing_held(pair.service, pair.client)


@pytest.mark.slow
async def test_without_a_target_fence_prefill_cancels_and_confirms_before_the_retry(tmp_path: Path) -> None:
    async with node_pair(
        tmp_path, transfer_timeout=0.5, decode_engine=lambda: UnfencedTcpEngine(name="decode")
    ) as pair:
        answers = stall_first(pair.prefill, "_answer_kv")
        reply = await turn(pair.client, pair.ledger, "a", prompt(2))
        assert reply["outcome"] == "finished", reply["reason"]
        assert len(answers) == 2 and pair.prefill.cancelled == 1
        assert pair.service.abandoned == 0
        await assert_nothing_held(pair.service, pair.client)


@pytest.mark.slow
async def test_an_unconfirmed_transfer_fails_its_request_and_keeps_its_pages_until_it_settles(
    tmp_path: Path,
) -> None:
    async with node_pair(
        tmp_path,
        transfer_timeout=0.5,
        fence_timeout=0.3,
        decode_engine=lambda: UnfencedTcpEngine(name="decode"),
    ) as pair:
        stall_first(pair.prefill, "_answer_kv")
        gate = trio.Event()
        cancels = stall_first(pair.prefill, "_cancel", gate)
        with trio.fail_after(GUARD_S):
            reply, _ = await pair.client.generate("a", prompt(3), 3)
        assert reply["outcome"] == "failed" and "abandoned" in reply["reason"], reply
        assert pair.service.abandoned == 1
        assert pair.service.audit()["check"] == "ok"
        pool = pair.service.core.device_pool
        owners = [pool.owner_of(s) for s in range(pool.capacity)]
        claimed = [o for o in owners if isinstance(o, tuple) and o[0] == "xfer"]
        assert len(claimed) == len(prompt(3)) // 16  # the transfer's pages, claimed by it
        assert not pair.service.core.idle
        gate.set()  # prefill can confirm now: the background retry gets its answer
        with trio.fail_after(GUARD_S):
            await pair.client.idle()
        assert len(cancels) >= 2
        await assert_nothing_held(pair.service, pair.client)
        with trio.fail_after(GUARD_S):  # the ended request is dropped once nothing refers to it
            while "a" in pair.service.core.requests:
                await trio.sleep(0.01)
        # The node serves the next request normally, on the pages given back.
        reply = await turn(pair.client, pair.ledger, "b", prompt(3))
        assert reply["outcome"] == "finished", reply["reason"]
