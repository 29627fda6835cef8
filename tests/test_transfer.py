"""The transfer engines: pages arrive exactly, notifications follow the data, bad input is refused.

Every engine-level test runs against both engines (NIXL ones skip when `nixl` cannot be
imported). Two-process tests drive `tests/transfer_peer.py` over its stdin/stdout. The TCP wire
protocol is attacked directly: peers that vanish mid-transfer and malformed frames.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import trio
from builders import examples
from engine_kinds import ENGINES
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transfer_peer import digest, initial_pages, wire_accept, wire_initiate

from hicache.runtime.transfer import (
    MAX_NOTIF_BYTES,
    MemoryRegion,
    NixlEngine,
    PeerInfo,
    TcpEngine,
    TransferEngine,
    TransferTimeout,
    XferState,
)
from hicache.runtime.transfer.base import Span
from hicache.runtime.transfer.tcp_wire import HEADER, MAGIC, SPAN, VERSION, Msg, encode_header

PEER_SCRIPT = Path(__file__).with_name("transfer_peer.py")
PAGES, PAGE_BYTES = 16, 4096
GUARD_S = 10  # a guard against hangs, never a speed assertion


def make_engine(kind: str, name: str) -> TransferEngine:
    return TcpEngine(name=name) if kind == "tcp" else NixlEngine(name)


@attrs.define
class World:
    """Two linked engines `a` and `b`, each with a torch pool "pool"; `b` also has "wide" pages."""

    a: TransferEngine
    b: TransferEngine
    ra: MemoryRegion
    rb: MemoryRegion
    pa: torch.Tensor
    pb: torch.Tensor


@contextlib.asynccontextmanager
async def linked(kind: str, pages: int = PAGES, page_bytes: int = PAGE_BYTES) -> AsyncIterator[World]:
    pa = torch.zeros((pages, page_bytes), dtype=torch.uint8)
    pb = torch.zeros((pages, page_bytes), dtype=torch.uint8)
    wide = torch.zeros((4, 2 * page_bytes), dtype=torch.uint8)
    async with make_engine(kind, "a") as a, make_engine(kind, "b") as b:
        assert isinstance(a, TransferEngine)
        ra = a.register("pool", pa)
        rb = b.register("pool", pb)
        b.register("wide", wide)
        assert await a.add_peer(b.local_info()) == "b"
        assert await b.add_peer(a.local_info()) == "a"
        yield World(a, b, ra, rb, pa, pb)


def fill(pool: torch.Tensor, rng: np.random.Generator) -> None:
    pool.copy_(torch.from_numpy(rng.integers(0, 256, tuple(pool.shape), dtype=np.uint8)))


# ---------------------------------------------------------------------------------------------
# One process, both engines


@pytest.mark.parametrize("kind", ENGINES)
@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
async def test_random_pages_arrive_exactly_and_the_notification_follows_the_data(
    kind: str, data: Any
) -> None:
    async with linked(kind) as w:
        for i in range(data.draw(st.integers(1, 3), label="transfers")):
            op = data.draw(st.sampled_from(["WRITE", "READ"]), label="op")
            k = data.draw(st.integers(1, PAGES), label="pages")
            lp = data.draw(st.permutations(range(PAGES)), label="local")[:k]
            rp = data.draw(st.permutations(range(PAGES)), label="remote")[:k]
            rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
            fill(w.pa, rng)
            fill(w.pb, rng)
            (src, sp), (dst, dp) = ((w.pa, lp), (w.pb, rp)) if op == "WRITE" else ((w.pb, rp), (w.pa, lp))
            expected = dst.clone()
            expected[dp] = src[sp]
            msg = f"{op} #{i} {k} pages".encode()
            handle = await w.a.post(op, w.ra, lp, "b", "pool", rp, msg)
            with trio.fail_after(GUARD_S):
                peer, got = await w.b.next_notif()
            # The notification is only sent once every page is in place.
            assert (peer, got) == ("a", msg)
            assert torch.equal(dst, expected)
            assert await w.a.wait(handle, timeout=GUARD_S) is XferState.DONE
            assert w.a.state(handle) is XferState.DONE
            w.a.release(handle)
            assert w.a.notifs() == [] and w.b.notifs() == []


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("kind", ENGINES)
async def test_the_notification_waits_for_the_last_byte_of_a_large_transfer(kind: str, op: str) -> None:
    # 16 MiB: more than loopback socket buffers hold, so the data arrives in many pieces.
    pages, page_bytes = 8, 2 << 20
    async with linked(kind, pages, page_bytes) as w:
        fill(w.pa, np.random.default_rng(1))
        fill(w.pb, np.random.default_rng(2))
        src, dst = (w.pa, w.pb) if op == "WRITE" else (w.pb, w.pa)
        expected = src.flip(0)
        handle = await w.a.post(op, w.ra, range(pages), "b", "pool", range(pages)[::-1], b"all here")
        with trio.fail_after(GUARD_S):
            assert await w.b.next_notif() == ("a", b"all here")
        assert torch.equal(dst, expected)
        assert await w.a.wait(handle, timeout=GUARD_S) is XferState.DONE


@pytest.mark.parametrize("kind", ENGINES)
async def test_zero_page_transfers_complete_with_their_notification(kind: str) -> None:
    async with linked(kind) as w:
        before = (w.pa.clone(), w.pb.clone())
        for op in ("WRITE", "READ"):
            handle = await w.a.post(op, w.ra, [], "b", "pool", [], f"{op} of nothing".encode())
            assert await w.a.wait(handle, timeout=GUARD_S) is XferState.DONE
            with trio.fail_after(GUARD_S):
                assert await w.b.next_notif() == ("a", f"{op} of nothing".encode())
        assert torch.equal(w.pa, before[0]) and torch.equal(w.pb, before[1])


@pytest.mark.parametrize("kind", ENGINES)
async def test_an_empty_notification_is_not_delivered(kind: str) -> None:
    async with linked(kind) as w:
        h1 = await w.a.post("WRITE", w.ra, [0], "b", "pool", [1], b"")
        h2 = await w.a.post("WRITE", w.ra, [2], "b", "pool", [3], b"second")
        assert await w.a.wait(h1, timeout=GUARD_S) is XferState.DONE
        assert await w.a.wait(h2, timeout=GUARD_S) is XferState.DONE
        with trio.fail_after(GUARD_S):
            assert await w.b.next_notif() == ("a", b"second")
        assert w.b.notifs() == []


BAD_REQUESTS: dict[str, tuple[dict[str, Any], str]] = {
    "local page out of range": (
        dict(local_pages=[0, PAGES]),
        f"page {PAGES}, outside region 'pool' of {PAGES}",
    ),
    "negative page": (dict(remote_pages=[-1, 2]), "page -1, outside"),
    "lengths differ": (dict(local_pages=[0, 1, 2]), "3 local pages, 2 remote pages"),
    "unknown region": (dict(remote_region="nope"), "no region 'nope'"),
    "unknown peer": (dict(peer="c"), "unknown peer 'c'"),
    "page_bytes differ": (dict(remote_region="wide", remote_pages=[0, 1]), f"{PAGE_BYTES}, remote region"),
    "repeated destination": (dict(remote_pages=[3, 3]), "repeat"),
    "bad op": (dict(op="COPY"), "'WRITE' or 'READ'"),
    "notif too long": (dict(notif=b"x" * (MAX_NOTIF_BYTES + 1)), f"at most {MAX_NOTIF_BYTES}"),
    "float pages": (dict(local_pages=[0.0, 1.0]), "integers"),
}


@pytest.mark.parametrize("kind", ENGINES)
async def test_invalid_requests_raise_value_error_naming_the_numbers(kind: str) -> None:
    async with linked(kind) as w:
        for case, (override, message) in BAD_REQUESTS.items():
            args = dict(op="WRITE", local_pages=[0, 1], peer="b", remote_region="pool", remote_pages=[2, 3])
            args.update(override)
            try:
                with pytest.raises(ValueError, match=re.escape(message)):
                    await w.a.post(args.pop("op"), w.ra, **args)
            except (AssertionError, pytest.fail.Exception) as e:
                e.add_note(f"bad request case: {case}")
                raise
        foreign = MemoryRegion("pool", 0, PAGE_BYTES, PAGES + 1)
        with pytest.raises(ValueError, match="not registered"):
            await w.a.post("WRITE", foreign, [0], "b", "pool", [0])
        other = "nixl" if kind == "tcp" else "tcp"
        info = PeerInfo(other, "x", {}, (MemoryRegion("pool", 0, 8, 8),)).encode()
        with pytest.raises(ValueError, match=f"is for a '{other}' engine"):
            await w.a.add_peer(info)
        assert w.b.notifs() == []


@pytest.mark.parametrize("kind", ENGINES)
async def test_a_removed_peer_is_forgotten_and_can_be_added_again(kind: str) -> None:
    async with linked(kind) as w:
        w.a.remove_peer("nobody")  # an unknown name: nothing happens
        w.a.remove_peer("b")
        with pytest.raises(ValueError, match="unknown peer 'b'"):
            await w.a.post("WRITE", w.ra, [0], "b", "pool", [0], b"gone")
        assert await w.a.add_peer(w.b.local_info()) == "b"
        w.pa[0] = 5
        handle = await w.a.post("WRITE", w.ra, [0], "b", "pool", [3], b"back")
        assert await w.a.wait(handle, timeout=GUARD_S) is XferState.DONE, w.a.reason(handle)
        with trio.fail_after(GUARD_S):
            assert await w.b.next_notif() == ("a", b"back")
        assert torch.equal(w.pb[3], w.pa[0])


def test_nixl_engine_without_nixl_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(ImportError, match=r"pip install nixl==1\.5\.1"):
        NixlEngine("x")


# ---------------------------------------------------------------------------------------------
# Peer info encoding


@settings(max_examples=examples(60), deadline=None)
@given(
    name=st.text(min_size=1, max_size=20),
    fields=st.dictionaries(st.text(max_size=10), st.binary(max_size=40), max_size=3),
    regions=st.lists(
        st.builds(
            MemoryRegion,
            st.text(max_size=12),
            st.integers(0, 2**64 - 1),
            st.integers(1, 2**40),
            st.integers(1, 2**40),
            st.sampled_from(["DRAM", "VRAM"]),
            st.integers(-1, 7),
        ),
        max_size=4,
    ),
    cut=st.integers(0, 400),
    flip=st.integers(0, 400),
)
def test_peer_info_round_trips_and_any_damage_is_a_value_error(
    name: str, fields: dict[str, bytes], regions: list[MemoryRegion], cut: int, flip: int
) -> None:
    info = PeerInfo("tcp", name, fields, tuple(regions))
    raw = info.encode()
    assert PeerInfo.decode(raw) == info
    damaged = [raw[: cut % len(raw)], raw + b"\0"]
    flipped = bytearray(raw)
    flipped[flip % len(raw)] ^= 0x5A
    damaged.append(bytes(flipped))
    for bad in damaged:
        with pytest.raises(ValueError, match="peer info"):
            PeerInfo.decode(bad)


# ---------------------------------------------------------------------------------------------
# Two processes


class PeerProcess:
    """`tests/transfer_peer.py` running in a subprocess; commands and replies are lines."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self._buf = b""
        self.info = b""

    @classmethod
    @contextlib.asynccontextmanager
    async def running(
        cls, kind: str, name: str, pages: int, page_bytes: int, seed: int
    ) -> AsyncIterator[PeerProcess]:
        cmd = [sys.executable, str(PEER_SCRIPT), "--engine", kind, "--name", name]
        cmd += ["--pages", str(pages), "--page-bytes", str(page_bytes), "--seed", str(seed)]
        proc = await trio.lowlevel.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        peer = cls(proc)
        try:
            with trio.fail_after(60):  # the first import of torch and nixl can be slow on a busy host
                peer.info = bytes.fromhex(await peer.expect("INFO"))
            yield peer
        finally:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await proc.stdin.aclose()
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def expect(self, tag: str) -> str:
        while True:
            while b"\n" not in self._buf:
                chunk = await self.proc.stdout.receive_some(1 << 16)
                if not chunk:
                    raise AssertionError(f"peer exited (rc={self.proc.poll()}) while we waited for @{tag}")
                self._buf += chunk
            line, self._buf = self._buf.split(b"\n", 1)
            text = line.decode()
            if text.startswith("@" + tag):
                return text[len(tag) + 1 :].strip()
            assert not text.startswith("@"), f"expected @{tag}, got {text!r}"

    async def ask(self, command: str, tag: str) -> str:
        await self.proc.stdin.send_all(command.encode() + b"\n")
        with trio.fail_after(GUARD_S):
            return await self.expect(tag)

    async def sums(self, pages: list[int]) -> list[str]:
        return (await self.ask("SUM " + ",".join(map(str, pages)), "SUM")).split(",")


@pytest.mark.process
@pytest.mark.parametrize("kind", ENGINES)
async def test_two_processes_write_read_back_then_the_peer_dies(kind: str) -> None:
    n, page_bytes = 24, 64 * 1024
    mine = torch.from_numpy(initial_pages(7, n, page_bytes))
    async with (
        PeerProcess.running(kind, "decode", n, page_bytes, seed=11) as peer,
        make_engine(kind, "prefill") as engine,
    ):
        region = engine.register("staging", mine)
        assert await engine.add_peer(peer.info) == "decode"
        assert await peer.ask("ADD " + engine.local_info().hex(), "PEER") == "prefill"
        theirs = initial_pages(11, n, page_bytes)
        assert await peer.sums(list(range(n))) == [digest(p) for p in theirs]

        src, dst = [5, 0, 17, 3, 9], [20, 1, 2, 11, 6]
        h = await engine.post("WRITE", region, src, "decode", "pool", dst, b"kv for req-1")
        assert await engine.wait(h, timeout=GUARD_S) is XferState.DONE, engine.reason(h)
        assert await peer.ask(f"NOTIF {GUARD_S}", "NOTIF") == "prefill " + b"kv for req-1".hex()
        assert await peer.sums(dst) == [digest(mine[p].numpy()) for p in src]
        untouched = [p for p in range(n) if p not in dst]
        assert await peer.sums(untouched) == [digest(theirs[p]) for p in untouched]

        back = [0, 1, 2, 3]
        h = await engine.post("READ", region, back, "decode", "pool", [20, 1, 8, 11], b"read done")
        assert await engine.wait(h, timeout=GUARD_S) is XferState.DONE, engine.reason(h)
        assert await peer.ask(f"NOTIF {GUARD_S}", "NOTIF") == "prefill " + b"read done".hex()
        assert [digest(mine[p].numpy()) for p in back] == await peer.sums([20, 1, 8, 11])
        assert await peer.ask("NOTIFS", "NOTIFS") == ""

        peer.proc.kill()
        await peer.proc.wait()
        h = await engine.post("WRITE", region, src, "decode", "pool", dst, b"too late")
        with trio.fail_after(GUARD_S):
            assert await engine.wait(h, timeout=GUARD_S) is XferState.ERR


@pytest.mark.process
async def test_tcp_peer_killed_mid_write_gives_err() -> None:
    n, page_bytes = 96, 1 << 20  # 96 MiB: far more than loopback socket buffers hold
    src = np.zeros((n, page_bytes), dtype=np.uint8)
    async with (
        PeerProcess.running("tcp", "victim", n, page_bytes, seed=-1) as peer,
        TcpEngine(name="initiator") as engine,
    ):
        region = engine.register("src", src)
        await engine.add_peer(peer.info)
        assert await peer.ask("ADD " + engine.local_info().hex(), "PEER") == "initiator"
        warm = await engine.post("WRITE", region, [0], "victim", "pool", [0])
        assert await engine.wait(warm, timeout=GUARD_S) is XferState.DONE
        os.kill(peer.proc.pid, signal.SIGSTOP)
        try:
            h = await engine.post("WRITE", region, range(n), "victim", "pool", range(n), b"never")
            await trio.sleep(0.3)
            assert engine.state(h) is XferState.PROC  # a stopped peer cannot have acknowledged
        finally:
            peer.proc.kill()
        with trio.fail_after(GUARD_S):
            assert await engine.wait(h, timeout=GUARD_S) is XferState.ERR
        assert "lost" in (engine.reason(h) or "")


# ---------------------------------------------------------------------------------------------
# TCP: fake peers that misbehave


@contextlib.asynccontextmanager
async def fake_peer(
    handler: Callable[[trio.SocketStream], Any], pages: int = PAGES, page_bytes: int = PAGE_BYTES
) -> AsyncIterator[bytes]:
    """A TCP listener that pretends to be engine "fake"; yields its peer info."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        port = listeners[0].socket.getsockname()[1]
        fields = {"host": b"127.0.0.1", "port": port.to_bytes(2, "little")}
        yield PeerInfo("tcp", "fake", fields, (MemoryRegion("pool", 0, page_bytes, pages),)).encode()
        nursery.cancel_scope.cancel()


async def recv_exactly(stream: trio.SocketStream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


async def read_frame(stream: trio.SocketStream) -> tuple[int, int, bytes, int, int, int]:
    magic, version, mtype, name_len, xid, count, page_bytes, notif_len = HEADER.unpack(
        await recv_exactly(stream, HEADER.size)
    )
    assert (magic, version) == (MAGIC, VERSION)
    return mtype, xid, await recv_exactly(stream, name_len), count, page_bytes, notif_len


async def handshake(stream: trio.SocketStream) -> None:
    """The fake target's side of the handshake (it holds the cluster secret)."""
    assert await wire_accept(stream, b"fake") == b"me"


@pytest.mark.parametrize("op", ["WRITE", "READ"])
async def test_tcp_peer_closing_after_half_the_payload_gives_err(op: str) -> None:
    pages = [0, 1, 2, 3]
    half = len(pages) * PAGE_BYTES // 2

    async def handler(stream: trio.SocketStream) -> None:
        await handshake(stream)
        mtype, xid, _, count, page_bytes, notif_len = await read_frame(stream)
        await recv_exactly(stream, 4 * count + notif_len)
        if mtype == Msg.WRITE:
            await recv_exactly(stream, half)
        else:
            await stream.send_all(encode_header(Msg.READ_DATA, xid, b"", count, page_bytes) + b"\1" * half)
        await stream.aclose()

    async with fake_peer(handler) as info, TcpEngine(name="me") as engine:
        region = engine.register("pool", np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8))
        await engine.add_peer(info)
        h = await engine.post(op, region, pages, "fake", "pool", pages, b"n")
        with trio.fail_after(GUARD_S):
            assert await engine.wait(h, timeout=GUARD_S) is XferState.ERR
        assert "lost" in (engine.reason(h) or "")


async def test_tcp_idle_connection_closed_by_the_peer_is_replaced() -> None:
    closed = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        await handshake(stream)  # then serve one WRITE and hang up
        _, xid, _, count, page_bytes, notif_len = await read_frame(stream)
        await recv_exactly(stream, 4 * count + notif_len + count * page_bytes)
        await stream.send_all(encode_header(Msg.ACK, xid))
        await stream.aclose()
        closed.set()

    async with fake_peer(handler) as info, TcpEngine(name="me") as engine:
        region = engine.register("pool", np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8))
        await engine.add_peer(info)
        for _ in range(3):
            closed = trio.Event()
            h = await engine.post("WRITE", region, [0], "fake", "pool", [0], b"n")
            assert await engine.wait(h, timeout=GUARD_S) is XferState.DONE, engine.reason(h)
            with trio.fail_after(GUARD_S):
                await closed.wait()


async def test_tcp_peer_that_never_answers_hello_gives_err() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with fake_peer(handler) as info, TcpEngine(name="me", handshake_timeout_s=0.2) as engine:
        region = engine.register("pool", np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8))
        await engine.add_peer(info)
        h = await engine.post("READ", region, [0], "fake", "pool", [0], b"n")
        with trio.fail_after(GUARD_S):
            assert await engine.wait(h, timeout=GUARD_S) is XferState.ERR
        assert "no HELLO_ACK from 'fake'" in (engine.reason(h) or "")


async def test_tcp_target_drops_a_connection_that_never_says_hello() -> None:
    async with TcpEngine(name="target", handshake_timeout_s=0.2) as engine:
        stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
        with trio.fail_after(GUARD_S):
            assert await stream.receive_some(1) == b""
        await stream.aclose()


async def test_tcp_silent_peer_times_out_and_release_cancels() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await handshake(stream)
        await trio.sleep_forever()

    async with fake_peer(handler) as info, TcpEngine(name="me") as engine:
        region = engine.register("pool", np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8))
        await engine.add_peer(info)
        h = await engine.post("WRITE", region, [0], "fake", "pool", [0], b"n")
        with trio.fail_after(GUARD_S), pytest.raises(TransferTimeout, match="still in flight"):
            await engine.wait(h, timeout=0.2)
        assert engine.state(h) is XferState.PROC
        engine.release(h)
        with pytest.raises(ValueError, match="unknown or already released"):
            engine.state(h)


async def test_tcp_peer_refusing_a_write_gives_err_with_its_reason() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await handshake(stream)
        _, xid, *_ = await read_frame(stream)
        text = b"disk on fire"
        await stream.send_all(encode_header(Msg.ERROR, xid, notif_len=len(text)) + text)
        await trio.sleep_forever()

    async with fake_peer(handler) as info, TcpEngine(name="me") as engine:
        region = engine.register("pool", np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8))
        await engine.add_peer(info)
        h = await engine.post("WRITE", region, [0], "fake", "pool", [0], b"n")
        with trio.fail_after(GUARD_S):
            assert await engine.wait(h, timeout=GUARD_S) is XferState.ERR
        assert "disk on fire" in (engine.reason(h) or "")


async def test_tcp_refusal_reason_reaches_an_initiator_that_is_still_sending() -> None:
    """Stale peer info claims 16 pages where the target has 4: the target refuses the request
    while 16 MiB of payload are still on their way, and the initiator reports its reason."""
    page_bytes = 2 << 20
    async with TcpEngine(name="t") as t, TcpEngine(name="i") as i:
        t.register("pool", np.zeros((4, page_bytes), np.uint8))
        fields = PeerInfo.decode(t.local_info()).fields
        await i.add_peer(PeerInfo("tcp", "t", fields, (MemoryRegion("pool", 0, page_bytes, 16),)).encode())
        await t.add_peer(i.local_info())
        region = i.register("src", np.ones((8, page_bytes), np.uint8))
        h = await i.post("WRITE", region, range(8), "t", "pool", range(8, 16), b"x")
        assert await i.wait(h, timeout=GUARD_S) is XferState.ERR
        assert "8 pages, region 'pool' has 4" in (i.reason(h) or "")
        assert t.notifs() == []


# ---------------------------------------------------------------------------------------------
# Span WRITEs: KV streamed by layer group


@pytest.mark.parametrize("kind", ENGINES)
@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
async def test_a_transfer_in_spans_lands_whole_and_notifies_once_with_its_last_span(
    kind: str, data: Any
) -> None:
    """How prefill streams KV by layer group: each span WRITE moves one slice of every page; the
    notification comes with the last, posted once the others are done, and not before."""
    groups = data.draw(st.integers(1, 6), label="groups")
    inner = st.sets(st.integers(1, PAGE_BYTES - 1), min_size=groups - 1, max_size=groups - 1)
    cuts = sorted(data.draw(inner, label="cuts"))
    bounds = [0, *cuts, PAGE_BYTES]
    k = data.draw(st.integers(1, PAGES), label="pages")
    lp = data.draw(st.permutations(range(PAGES)), label="local")[:k]
    rp = data.draw(st.permutations(range(PAGES)), label="remote")[:k]
    async with linked(kind) as w:
        fill(w.pa, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed")))
        expected = w.pb.clone()
        expected[rp] = w.pa[lp]
        for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            last = g == len(bounds) - 2
            span = Span(lo, hi - lo)
            h = await w.a.post("WRITE", w.ra, lp, "b", "pool", rp, b"kv:7", span=span, final=last)
            assert await w.a.wait(h, timeout=GUARD_S) is XferState.DONE
            w.a.release(h)
            if not last:
                assert w.b.notifs() == []  # a part is never announced
                assert torch.equal(w.pb[rp][:, lo:hi], w.pa[lp][:, lo:hi])
        with trio.fail_after(GUARD_S):
            assert await w.b.next_notif() == ("a", b"kv:7")
        assert torch.equal(w.pb, expected)


@pytest.mark.parametrize("kind", ENGINES)
async def test_a_bad_span_is_a_value_error_before_anything_moves(kind: str) -> None:
    async with linked(kind) as w:
        for bad in (Span(0, 0), Span(-1, 8), Span(PAGE_BYTES - 4, 8)):
            with pytest.raises(ValueError, match="span: expected"):
                await w.a.post("WRITE", w.ra, [0], "b", "pool", [0], b"x", span=bad)
        with pytest.raises(ValueError, match="only a WRITE"):
            await w.a.post("READ", w.ra, [0], "b", "pool", [0], b"x", span=Span(0, 8))


async def test_tcp_a_fenced_transfer_refuses_its_later_spans() -> None:
    """A decode node that gave up on a streamed transfer fences its notification: a span still
    to come is refused before any byte of it lands."""
    async with linked("tcp") as w:
        fill(w.pa, np.random.default_rng(3))
        before = w.pb.clone()
        assert await w.b.fence(b"kv:9") is True
        h = await w.a.post("WRITE", w.ra, [1, 2], "b", "pool", [3, 4], b"kv:9", span=Span(0, 64), final=False)
        assert await w.a.wait(h, timeout=GUARD_S) is XferState.ERR
        assert "fenced" in (w.a.reason(h) or "")
        assert torch.equal(w.pb, before) and w.b.notifs() == []


# ---------------------------------------------------------------------------------------------
# TCP: malformed frames sent to a real engine


@attrs.frozen
class Outcome:
    replies: list[int]  # message types received before the target closed
    notifs: list[tuple[str, bytes]]
    error: str


# How the target knows the hand-written peer "raw" (which never listens: it only connects).
RAW_INFO = PeerInfo("tcp", "raw", {"host": b"127.0.0.1", "port": (9).to_bytes(2, "little")}, ()).encode()


@contextlib.asynccontextmanager
async def target() -> AsyncIterator[tuple[TcpEngine, np.ndarray]]:
    pool = initial_pages(3, PAGES, PAGE_BYTES)
    async with TcpEngine(name="target") as engine:
        engine.register("pool", pool)
        await engine.add_peer(RAW_INFO)
        yield engine, pool


async def send_raw(engine: TcpEngine, payload: bytes, *, hello: bool = True) -> Outcome:
    """Send `payload` (after the handshake as peer "raw" unless told otherwise), half-close, and
    read until EOF."""
    stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
    replies, error = [], ""
    try:
        if hello:
            await wire_initiate(stream, b"raw")
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(payload)
            stream.socket.shutdown(socket.SHUT_WR)
        with trio.fail_after(GUARD_S):
            while True:
                try:
                    mtype, xid, _, count, page_bytes, notif_len = await read_frame(stream)
                except (EOFError, trio.BrokenResourceError):
                    break
                replies.append(mtype)
                body = await recv_exactly(
                    stream, notif_len + (count * page_bytes if mtype == Msg.READ_DATA else 0)
                )
                if mtype == Msg.ERROR:
                    error = body.decode()
    finally:
        await stream.aclose()
    return Outcome(replies, engine.notifs(), error)


async def assert_still_serving(engine: TcpEngine, pool: np.ndarray) -> None:
    page = bytes(range(256)) * (PAGE_BYTES // 256)
    frame = encode_header(Msg.WRITE, 9, b"pool", 1, PAGE_BYTES, 2) + struct.pack("<I", 5) + b"ok" + page
    outcome = await send_raw(engine, frame)
    assert outcome.replies == [Msg.ACK]
    assert outcome.notifs == [("raw", b"ok")]
    assert bytes(pool[5]) == page


MALFORMED: dict[str, tuple[bytes, str]] = {
    "bad magic": (encode_header(Msg.WRITE, 1, b"pool", 1, PAGE_BYTES, magic=b"NOPE"), "bad magic"),
    "bad version": (encode_header(Msg.WRITE, 1, b"pool", 1, PAGE_BYTES, version=9), "version 9"),
    "unknown type": (encode_header(77, 1), "unknown message type 77"),
    "oversized count": (encode_header(Msg.WRITE, 1, b"pool", 2**32 - 1, PAGE_BYTES), f"has {PAGES}"),
    "oversized page_bytes": (encode_header(Msg.WRITE, 1, b"pool", 1, 2**63), "page_bytes"),
    "oversized notif": (encode_header(Msg.WRITE, 1, b"pool", 0, PAGE_BYTES, 2**32 - 1), "notif of"),
    "oversized name": (HEADER.pack(MAGIC, VERSION, Msg.WRITE, 65535, 1, 0, 0, 0), "name of 65535"),
    "unknown region": (encode_header(Msg.WRITE, 1, b"other", 1, PAGE_BYTES), "unknown region 'other'"),
    "index out of range": (
        encode_header(Msg.WRITE, 1, b"pool", 2, PAGE_BYTES) + struct.pack("<2I", 1, PAGES),
        f"page {PAGES} out of range",
    ),
    "repeated destination": (
        encode_header(Msg.WRITE, 1, b"pool", 2, PAGE_BYTES) + struct.pack("<2I", 4, 4),
        "destination pages repeat",
    ),
    "hello twice": (encode_header(Msg.HELLO, 0, b"raw", notif_len=16) + b"n" * 16, "expected WRITE or READ"),
    "auth twice": (encode_header(Msg.AUTH, 0, notif_len=32) + b"p" * 32, "expected WRITE or READ"),
    "ack sent to the target": (encode_header(Msg.ACK, 1), "expected WRITE or READ"),
    "span past the page": (
        encode_header(Msg.WRITE_SPAN, 1, b"pool", 1, 64)
        + struct.pack("<I", 2)
        + SPAN.pack(PAGE_BYTES - 32, 1),
        "past the region's pages",
    ),
    "span longer than a page": (
        encode_header(Msg.WRITE_SPAN, 1, b"pool", 1, PAGE_BYTES + 1),
        "bytes per page",
    ),
    "span of nothing": (encode_header(Msg.WRITE_SPAN, 1, b"pool", 1, 0), "bytes per page"),
    "span neither final nor not": (
        encode_header(Msg.WRITE_SPAN, 1, b"pool", 1, 64) + struct.pack("<I", 2) + SPAN.pack(0, 2),
        "final 2 not 0 or 1",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_tcp_target_rejects_malformed_frames_without_allocating_their_claims(case: str) -> None:
    frame, message = MALFORMED[case]
    async with target() as (engine, pool):
        before = pool.copy()
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            outcome = await send_raw(engine, frame + b"\0" * 64)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert outcome.replies == [Msg.ERROR]
        assert message in outcome.error
        assert outcome.notifs == []
        assert np.array_equal(pool, before)
        assert peak < 4 << 20, f"handling the frame allocated {peak} bytes"
        await assert_still_serving(engine, pool)


@pytest.mark.parametrize("cut", [0, 5, HEADER.size - 1, HEADER.size + 2, HEADER.size + 4 + 8])
async def test_tcp_truncated_frames_are_dropped_without_a_notification(cut: int) -> None:
    frame = encode_header(Msg.WRITE, 1, b"pool", 2, PAGE_BYTES, 4) + struct.pack("<2I", 1, 2) + b"note"
    frame += b"\7" * (2 * PAGE_BYTES)
    async with target() as (engine, pool):
        for hello in (True, False):
            outcome = await send_raw(engine, frame[:cut] if hello else frame[: max(cut - 1, 0)], hello=hello)
            assert outcome.notifs == []
            assert outcome.replies in ([], [Msg.ERROR])
        await assert_still_serving(engine, pool)


async def test_tcp_read_without_read_done_delivers_no_notification() -> None:
    request = encode_header(Msg.READ, 4, b"pool", 2, PAGE_BYTES, 3) + struct.pack("<2I", 7, 7) + b"abc"
    async with target() as (engine, pool):
        for tail in (b"", encode_header(Msg.READ_DONE, 4)[:-1], encode_header(Msg.READ_DONE, 5)):
            outcome = await send_raw(engine, request + tail)
            assert outcome.replies[0] == Msg.READ_DATA
            assert outcome.notifs == []
        outcome = await send_raw(engine, request + encode_header(Msg.READ_DONE, 4))
        assert outcome.replies == [Msg.READ_DATA]
        assert outcome.notifs == [("raw", b"abc")]


HEADER_FIELDS = ("magic", "version", "type", "name", "count", "page_bytes", "indices", "notif_len", "cut")


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    broken=st.sets(st.sampled_from(HEADER_FIELDS), max_size=3),
    mtype=st.sampled_from([Msg.WRITE, Msg.READ]),
    indices=st.lists(st.integers(0, PAGES - 1), max_size=4, unique=True),
    xid=st.integers(0, 2**64 - 1),
    notif=st.binary(max_size=8),
    data=st.data(),
)
async def test_tcp_target_survives_random_headers(
    broken: set[str], mtype: int, indices: list[int], xid: int, notif: bytes, data: Any
) -> None:
    """Requests with a few fields replaced by random values (maybe truncated): only a complete valid
    one is acted on, a rejected one never touches the pages, and the target keeps serving."""

    def field(key: str, valid: Any, wild: st.SearchStrategy[Any]) -> Any:
        return data.draw(wild, label=key) if key in broken else valid

    magic = field("magic", MAGIC, st.binary(min_size=4, max_size=4))
    version = field("version", VERSION, st.integers(0, 255))
    mtype = field("type", mtype, st.integers(0, 255))
    name = field("name", b"pool", st.binary(max_size=6))
    indices = field("indices", indices, st.lists(st.integers(0, 2**32 - 1), max_size=4))
    # Lengths are only ever over-claimed: an under-claimed one makes a shorter valid frame
    # followed by garbage, which is two messages, not one malformed one.
    count = field("count", len(indices), st.integers(len(indices) + 1, 2**32 - 1))
    page_bytes = field("page_bytes", PAGE_BYTES, st.integers(0, 2**64 - 1))
    notif_len = field("notif_len", len(notif), st.integers(len(notif) + 1, 2**32 - 1))
    cut = field("cut", None, st.integers(0, HEADER.size + 64))

    request = HEADER.pack(magic, version, mtype, len(name), xid, count, page_bytes, notif_len)
    request += name + b"".join(struct.pack("<I", i) for i in indices) + notif
    written = [bytes([i * 31 % 251 + 1]) * PAGE_BYTES for i in range(len(indices))]
    if mtype == Msg.WRITE:
        request += b"".join(written)
    frame = request + (encode_header(Msg.READ_DONE, xid) if mtype == Msg.READ else b"")
    sent = frame if cut is None else frame[:cut]

    header_ok = (
        magic == MAGIC
        and version == VERSION
        and mtype in (Msg.WRITE, Msg.READ)
        and name == b"pool"
        and page_bytes == PAGE_BYTES
        and count <= PAGES
        and notif_len <= MAX_NOTIF_BYTES
    )
    valid = (
        header_ok
        and count == len(indices)
        and notif_len == len(notif)
        and all(i < PAGES for i in indices)
        and (mtype == Msg.READ or len(set(indices)) == len(indices))
    )
    complete = len(sent) == len(frame)
    async with target() as (engine, pool):
        before = pool.copy()
        outcome = await send_raw(engine, sent)
        event(f"valid={valid} complete={complete}")
        if valid and complete:
            assert outcome.replies == [Msg.ACK if mtype == Msg.WRITE else Msg.READ_DATA]
            assert outcome.notifs == ([("raw", notif)] if notif else [])
        elif valid and mtype == Msg.READ and len(sent) >= len(request):
            assert outcome.replies == [Msg.READ_DATA]  # data sent, READ_DONE never came
            assert outcome.notifs == []
        else:
            assert Msg.ACK not in outcome.replies and outcome.replies.count(Msg.ERROR) <= 1
            assert set(outcome.replies) <= {Msg.ERROR, Msg.READ_DATA}
            assert outcome.notifs == []
        if valid and mtype == Msg.WRITE and complete:
            assert [bytes(pool[i]) for i in indices] == written
        elif not (header_ok and mtype == Msg.WRITE):
            # Refused by its header: never touches the pages. (A WRITE whose header passes but
            # whose bytes run short may have written part of a page: see the tcp module notes.)
            assert np.array_equal(pool, before)
        await assert_still_serving(engine, pool)
