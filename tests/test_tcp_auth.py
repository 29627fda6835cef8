"""The TCP engine's peers: only an engine a node was introduced to, and that proves it holds the
cluster secret, can write into or read from the node's regions; a known name cannot be rebound.

Engine pairs show the outcome a node sees (a transfer that ends `ERR` with a reason, a region
left as it was, no notification); hand-written clients (`transfer_peer.wire_hello`) show what
the target does with a handshake that is missing, wrong or replayed.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import numpy as np
import pytest
import trio
from builders import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transfer_peer import initial_pages, recv_exactly, wire_hello, wire_initiate

from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.transfer import MemoryRegion, PeerInfo, TcpEngine, XferState
from hicache.runtime.transfer.tcp_handshake import ACCEPTOR_PURPOSE, INITIATOR_PURPOSE, handshake_proof
from hicache.runtime.transfer.tcp_wire import HEADER, MAC_BYTES, Msg, encode_header

PAGES, PAGE_BYTES = 8, 4096
GUARD_S = 10  # a guard against hangs, never a speed assertion
OTHER = ClusterSecret.of("not the cluster's secret")


def info_at(name: str, port: int, regions: tuple[MemoryRegion, ...] = ()) -> bytes:
    fields = {"host": b"127.0.0.1", "port": port.to_bytes(2, "little")}
    return PeerInfo("tcp", name, fields, regions).encode()


RAW = info_at("raw", 9)  # the hand-written client: it never listens, it only connects
POOL = MemoryRegion("pool", 0, PAGE_BYTES, PAGES)  # how "target" registers its pool


@contextlib.asynccontextmanager
async def target(**kwargs: object) -> AsyncIterator[tuple[TcpEngine, np.ndarray]]:
    """Engine "target" with a region "pool" (random bytes), knowing the hand-written peer "raw"."""
    pool = initial_pages(5, PAGES, PAGE_BYTES)
    async with TcpEngine(name="target", **kwargs) as engine:  # type: ignore[arg-type]
        engine.register("pool", pool)
        await engine.add_peer(RAW)
        yield engine, pool


def write_frame(xid: int, pages: list[int], notif: bytes, fill: int = 0xAB) -> bytes:
    head = encode_header(Msg.WRITE, xid, b"pool", len(pages), PAGE_BYTES, len(notif))
    return head + struct.pack(f"<{len(pages)}I", *pages) + notif + bytes([fill]) * (len(pages) * PAGE_BYTES)


def read_frame_request(xid: int, pages: list[int], notif: bytes) -> bytes:
    head = encode_header(Msg.READ, xid, b"pool", len(pages), PAGE_BYTES, len(notif))
    return head + struct.pack(f"<{len(pages)}I", *pages) + notif + encode_header(Msg.READ_DONE, xid)


async def replies(stream: trio.SocketStream) -> tuple[list[int], str]:
    """The message types the target sends until it closes, and the text of its ERROR."""
    types, error = [], ""
    with trio.fail_after(GUARD_S):
        while True:
            try:
                head = await recv_exactly(stream, HEADER.size)
            except (EOFError, trio.BrokenResourceError):
                return types, error
            _, _, mtype, name_len, _, count, page_bytes, notif_len = HEADER.unpack(head)
            types.append(mtype)
            body = await recv_exactly(stream, name_len + notif_len + count * page_bytes)
            if mtype == Msg.ERROR:
                error = body[name_len:].decode(errors="replace")


async def send_and_close(stream: trio.SocketStream, data: bytes) -> None:
    """Send what the target may refuse halfway (it closes), then half-close."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        await stream.send_all(data)
        stream.socket.shutdown(socket.SHUT_WR)


# ---------------------------------------------------------------------------------------------
# Engines


@pytest.mark.parametrize("op", ["WRITE", "READ"])
async def test_an_engine_with_another_secret_can_neither_write_nor_read(op: str) -> None:
    mine = np.full((PAGES, PAGE_BYTES), 7, dtype=np.uint8)
    async with target() as (t, pool), TcpEngine(name="stranger", secret=OTHER) as s:
        before = pool.copy()
        region = s.register("pool", mine)
        # Both sides know each other, as nodes whose control connection met would.
        await s.add_peer(t.local_info())
        await t.add_peer(s.local_info())
        h = await s.post(op, region, [0, 1, 2], "target", "pool", [3, 4, 5], b"kv:1")
        with trio.fail_after(GUARD_S):
            assert await s.wait(h, timeout=GUARD_S) is XferState.ERR
        assert "does not hold the cluster secret" in (s.reason(h) or ""), s.reason(h)
        # And the other way round: the target, initiating, does not trust the stranger either.
        back = await t.post(op, POOL, [0], "stranger", "pool", [0], b"kv:2")
        with trio.fail_after(GUARD_S):
            assert await t.wait(back, timeout=GUARD_S) is XferState.ERR
        assert "does not hold the cluster secret" in (t.reason(back) or "")
        await trio.sleep(0.05)
        assert t.notifs() == [] and s.notifs() == []
    assert np.array_equal(pool, before)
    assert (mine == 7).all()


async def test_an_engine_the_target_does_not_know_is_refused_until_added_and_after_removal() -> None:
    mine = np.full((PAGES, PAGE_BYTES), 7, dtype=np.uint8)
    async with target() as (t, pool), TcpEngine(name="unknown") as u:
        before = pool.copy()
        region = u.register("pool", mine)
        await u.add_peer(t.local_info())  # the initiator knows the target; not the other way round
        for op in ("WRITE", "READ"):
            h = await u.post(op, region, [0], "target", "pool", [1], b"kv:1")
            with trio.fail_after(GUARD_S):
                assert await u.wait(h, timeout=GUARD_S) is XferState.ERR
            assert "HELLO refused" in (u.reason(h) or "") and "'unknown'" in (u.reason(h) or "")
        assert t.notifs() == [] and np.array_equal(pool, before) and (mine == 7).all()

        await t.add_peer(u.local_info())  # introduced: now it may write
        h = await u.post("WRITE", region, [0], "target", "pool", [1], b"kv:2")
        assert await u.wait(h, timeout=GUARD_S) is XferState.DONE, u.reason(h)
        assert t.notifs() == [("unknown", b"kv:2")] and (pool[1] == 7).all()
        u.release(h)

        t.remove_peer("unknown")  # forgotten: its pooled connection is cut off, a new one refused
        t.remove_peer("never-known")  # a no-op
        await trio.sleep(0.05)  # the cut-off connection closes once its task runs
        h = await u.post("WRITE", region, [0], "target", "pool", [2], b"kv:3")
        with trio.fail_after(GUARD_S):
            assert await u.wait(h, timeout=GUARD_S) is XferState.ERR
        assert "not a peer 'target' knows" in (u.reason(h) or ""), u.reason(h)
        assert t.notifs() == [] and np.array_equal(pool[2], before[2])


async def test_a_known_name_cannot_be_rebound_to_another_address() -> None:
    real_pool = np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8)
    fake_pool = np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8)
    mine = np.full((PAGES, PAGE_BYTES), 9, dtype=np.uint8)
    async with (
        TcpEngine(name="node") as node,
        TcpEngine(name="decode") as real,
        TcpEngine(name="decode") as impostor,  # holds the secret, but another address
    ):
        region = node.register("src", mine)
        real.register("pool", real_pool)
        impostor.register("pool", fake_pool)
        await real.add_peer(node.local_info())
        await impostor.add_peer(node.local_info())
        assert await node.add_peer(real.local_info()) == "decode"
        assert await node.add_peer(real.local_info()) == "decode"  # the same address: an update
        with pytest.raises(ValueError, match="already bound") as refused:
            await node.add_peer(impostor.local_info())
        message = str(refused.value)
        assert "'decode'" in message
        assert f"127.0.0.1:{real.port}" in message and f"127.0.0.1:{impostor.port}" in message

        h = await node.post("WRITE", region, [0, 1], "decode", "pool", [2, 3], b"kv")
        assert await node.wait(h, timeout=GUARD_S) is XferState.DONE, node.reason(h)
        assert (real_pool[2:4] == 9).all() and not fake_pool.any()
        assert real.notifs() == [("node", b"kv")] and impostor.notifs() == []

        # Once forgotten (its control connection ended), the name is free again.
        node.remove_peer("decode")
        assert await node.add_peer(impostor.local_info()) == "decode"


async def test_remove_peer_cuts_off_a_write_that_is_landing() -> None:
    async with target() as (engine, pool):
        before = pool.copy()
        stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
        with trio.fail_after(GUARD_S):
            await wire_initiate(stream, b"raw")
            frame = write_frame(1, [0, 1, 2, 3], b"kv:late", fill=0x55)
            head = HEADER.size + 4 + 4 * 4 + len(b"kv:late")
            await stream.send_all(frame[: head + PAGE_BYTES + 100])
            while not (pool[0] == 0x55).all():
                await trio.sleep(0.005)
            engine.remove_peer("raw")
            await trio.sleep(0.05)
            after = pool.copy()
            await send_and_close(stream, frame[head + PAGE_BYTES + 100 :])
            types, _ = await replies(stream)
            await stream.aclose()
        assert Msg.ACK not in types and engine.notifs() == []
    assert (pool == after).all()  # not a byte after the removal
    assert np.array_equal(pool[2:], before[2:])


# ---------------------------------------------------------------------------------------------
# Hand-written clients


BAD_AUTHS = ("none", "zeros", "reflected", "replayed", "another secret")


def bad_auth(kind: str, parts: tuple[bytes, bytes, bytes, bytes], recorded: bytes) -> bytes | None:
    """The AUTH proof a client without the secret might try (None: it sends no AUTH at all)."""
    match kind:
        case "zeros":
            return bytes(MAC_BYTES)
        case "reflected":  # the target's own HELLO_ACK proof, sent back to it
            return handshake_proof(ClusterSecret.load(), ACCEPTOR_PURPOSE, *parts)
        case "replayed":  # recorded from an earlier good connection
            return recorded
        case "another secret":  # made right, but with a secret other than the cluster's
            return handshake_proof(OTHER, INITIATOR_PURPOSE, *parts)
    return None


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("auth", BAD_AUTHS)
async def test_a_request_without_a_valid_auth_is_refused_and_never_served(auth: str, op: str) -> None:
    async with target() as (engine, pool):
        # An earlier good connection, whose AUTH an eavesdropper recorded.
        good = await trio.open_tcp_stream("127.0.0.1", engine.port)
        with trio.fail_after(GUARD_S):
            recorded = await wire_initiate(good, b"raw")
            await send_and_close(good, write_frame(1, [7], b"kv:good", fill=0x11))
            assert (await replies(good))[0] == [Msg.ACK]
        await good.aclose()
        assert engine.notifs() == [("raw", b"kv:good")]
        before = pool.copy()

        stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
        with trio.fail_after(GUARD_S):
            parts, ok = await wire_hello(stream, b"raw")
            assert ok  # the target proved itself; now it is the client's turn
            proof = bad_auth(auth, parts, recorded)
            sent = b"" if proof is None else encode_header(Msg.AUTH, 0, notif_len=MAC_BYTES) + proof
            if op == "WRITE":
                request = write_frame(2, [0, 1], b"kv:bad")
            else:
                request = read_frame_request(2, [0, 1], b"kv:bad")
            await send_and_close(stream, sent + request)
            types, error = await replies(stream)
        await stream.aclose()
        assert types == [Msg.ERROR], (types, error)
        assert ("expected AUTH" if proof is None else "wrong proof") in error
        assert engine.notifs() == []
        assert np.array_equal(pool, before)


async def test_a_client_that_never_sends_auth_is_dropped_after_the_handshake_timeout() -> None:
    async with target(handshake_timeout_s=0.2) as (engine, _):
        stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
        with trio.fail_after(GUARD_S):
            _, ok = await wire_hello(stream, b"raw")
            assert ok
            assert await stream.receive_some(1) == b""  # closed, without waiting for a request
        await stream.aclose()


async def test_a_hello_naming_an_engine_the_target_does_not_know_is_refused() -> None:
    async with target() as (engine, pool):
        before = pool.copy()
        stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
        with trio.fail_after(GUARD_S), pytest.raises(ConnectionRefusedError, match="'somebody'"):
            await wire_hello(stream, b"somebody")
        await stream.aclose()
        assert engine.notifs() == [] and np.array_equal(pool, before)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(proof=st.binary(min_size=MAC_BYTES, max_size=MAC_BYTES) | st.binary(max_size=2 * MAC_BYTES))
async def test_random_auth_bytes_never_authenticate(proof: bytes) -> None:
    async with target() as (engine, pool):
        before = pool.copy()
        stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
        with trio.fail_after(GUARD_S):
            _, ok = await wire_hello(stream, b"raw")
            assert ok
            auth = encode_header(Msg.AUTH, 0, notif_len=len(proof)) + proof
            await send_and_close(stream, auth + write_frame(1, [0, 1], b"kv:guess"))
            types, error = await replies(stream)
        await stream.aclose()
        assert types == [Msg.ERROR] and "AUTH" in error, (types, error)
        assert engine.notifs() == [] and np.array_equal(pool, before)
