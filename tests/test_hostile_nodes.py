"""Hostile peers against live nodes: nothing a client or a peer sends stops a node, and what
they can make it hold is bounded by its `Limits`.

A prefill node and a decode node run in this process (TCP engine). Attackers send control
frames that once stopped the decode node (JSON nested 1,000 deep, a 4,301-digit integer, a
`tenant` that is a lone surrogate), hypothesis-generated frames of every kind (any JSON, deep
nesting, huge numbers, lone surrogates, wrong types in every field, lies in the header,
truncated frames, oversized lengths), half-sent frames that stall, and many large frames at
once. After each, a request the ledger verifies bit-exactly still succeeds, the node answered
or logged a reason, and the node's count of connections and frame bytes in flight is back where
it was: memory stays within the stated bound (the cap on frame bytes in flight plus slack).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import struct
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import attrs
import hypothesis.strategies as st
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, Phase, event, given, settings
from node_pair import (
    GUARD_S,
    PAGE,
    assert_nothing_held,
    authenticated,
    authenticated_socket,
    exchange,
    prompt,
    small_core,
    stand_in_hello,
    turn,
)

from hicache.core.config import DecodeConfig
from hicache.runtime.decode.decode_node import DecodeService
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.prefill.prefill_node import PrefillNode
from hicache.runtime.security.api_keys import ApiKeys, Principal, digest
from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.security.limits import Gate, Limits
from hicache.runtime.storage.memory_store import MemoryStore
from hicache.runtime.transfer.tcp import TcpEngine
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire import compat, protocol
from hicache.runtime.wire.client import DecodeClient

MiB = 1 << 20
SLACK = 128 * MiB  # for the allocator: 1 MiB reads and growing buffers fragment the heap
NODES = ["decode", "prefill"]
ADMIN_KEY = "sk-admin-of-the-hostile-tests"


def frame(body: bytes, n_json: int | None = None, n_bin: int = 0, magic: bytes = protocol.MAGIC) -> bytes:
    """A frame header (maybe lying about the lengths) followed by `body`."""
    n = len(body) if n_json is None else n_json
    return struct.pack("<4sBIQ", magic, protocol.VERSION, n, n_bin) + body


# The three frames that stopped the decode node (finding 1): RecursionError, ValueError and
# UnicodeEncodeError escaped its connection handler.
DEEP = frame(b'{"op":"generate","x":' + b"[" * 1000 + b"]" * 1000 + b"}")
DIGITS = frame(b'{"op":"generate","x":' + b"9" * 4301 + b"}")
SURROGATE = frame(
    json.dumps({"op": "generate", "rid": "s", "tokens": [1, 2, 3], "max_new": 1, "tenant": "\udc00"}).encode()
)
FATAL = {"deep": DEEP, "digits": DIGITS, "surrogate": SURROGATE}
FATAL_REASON = {"deep": "nested too deep", "digits": "4300 digits", "surrogate": "field 'tenant'"}


# ============================================================================ the nodes


@attrs.define
class Nodes:
    """A prefill and a decode node in this process, a client, and a stand-in peer engine whose
    info lets an attacker say a valid hello to prefill."""

    service: DecodeService
    prefill: PrefillNode
    client: DecodeClient
    ledger: KVLedger
    decode_port: int
    prefill_port: int
    stranger: TcpEngine
    served: int = 0

    def port(self, node: str) -> int:
        return self.decode_port if node == "decode" else self.prefill_port

    def gate(self, node: str) -> Gate:
        return self.service.gate if node == "decode" else self.prefill.gate

    def hello(self) -> bytes:
        mine = compat.profile(self.prefill.layout, self.stranger, self.prefill.model.config)
        return protocol.encode({"op": "hello", "info": self.stranger.local_info().hex(), "profile": mine})

    async def verified(self) -> dict[str, Any]:
        """A fresh request (a new prompt: prefill computes it) that the ledger checks bit-exactly."""
        self.served += 1
        reply = await turn(self.client, self.ledger, f"verified-{self.served}", prompt(1000 + self.served))
        assert reply["outcome"] == "finished", reply
        return reply


@contextlib.asynccontextmanager
async def nodes(
    decode_limits: Limits | None = None,
    prefill_limits: Limits | None = None,
    api_keys: ApiKeys | None = None,
) -> AsyncIterator[Nodes]:
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    core = small_core()
    async with (
        TcpEngine(name="prefill") as p_engine,
        TcpEngine(name="decode") as d_engine,
        TcpEngine(name="stranger") as stranger,
        trio.open_nursery() as nursery,
    ):
        stranger.register("L1", np.zeros((8, layout.page_bytes), dtype=np.uint8))
        prefill = PrefillNode(model, layout, p_engine, staging_pages=64, limits=prefill_limits)
        listeners = await nursery.start(prefill.serve, 0)
        prefill_port = listeners[0].socket.getsockname()[1]
        service = DecodeService(
            core, model, layout, MemoryStore(layout), d_engine, limits=decode_limits, api_keys=api_keys
        )
        decode_port = await nursery.start(service.run, 0, ("127.0.0.1", prefill_port))
        key = ADMIN_KEY if api_keys is not None else None
        client = await DecodeClient.connect("127.0.0.1", decode_port, api_key=key)
        try:
            yield Nodes(service, prefill, client, KVLedger(model, PAGE), decode_port, prefill_port, stranger)
        finally:
            await client.aclose()
            nursery.cancel_scope.cancel()


def logged(caplog: pytest.LogCaptureFixture, node: str, text: str) -> bool:
    return any(
        r.name == f"hicache.runtime.{node}" and r.levelno >= logging.WARNING and text in r.getMessage()
        for r in caplog.records
    )


# ============================================================================ finding 1: one frame


def fatal_cases(node: str, which: str, hello: bytes) -> list[tuple[bytes, str]]:
    """(bytes to send, what the error must say). Prefill gets each frame as its first and after
    a valid hello; its own messages carry a lone surrogate where the decode node's had one."""
    if node == "decode":
        return [(FATAL[which], FATAL_REASON[which])]
    if which != "surrogate":
        return [(FATAL[which], FATAL_REASON[which]), (hello + FATAL[which], FATAL_REASON[which])]
    bad_hello = protocol.encode({"op": "hello", "info": "\udc00"})
    bad_kv = protocol.encode({"op": "kv", "tid": "\udc00", "tokens": [1], "start": 0, "end": 0, "dst": []})
    return [
        (SURROGATE, "expected 'hello'"),
        (hello + SURROGATE, "unknown message 'generate'"),
        (bad_hello, "field 'info'"),
        (hello + bad_kv, "field 'tid' has the wrong type (str), expected int"),
    ]


@pytest.mark.parametrize("node", NODES)
@pytest.mark.parametrize("which", sorted(FATAL))
async def test_one_bad_frame_ends_only_its_connection(
    node: str, which: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each frame that stopped the decode node is answered with an error naming the problem and
    logged; the node serves a verified request after each."""
    caplog.set_level(logging.INFO)
    async with nodes() as n:
        await n.verified()
        secret = n.prefill.secret if node == "prefill" else None  # past the handshake
        for data, named in fatal_cases(node, which, n.hello()):
            replies = await exchange(n.port(node), data, secret=secret)
            assert replies and replies[-1]["op"] == "error", replies
            reason = replies[-1]["reason"]
            assert named in reason, reason
            assert logged(caplog, node, reason), reason
            await n.verified()
        await assert_nothing_held(n.service, n.client)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tenant": 5}, "field 'tenant' has the wrong type (int), expected str"),
        ({"tenant": "a\ud800"}, "field 'tenant' must be a string of Unicode text"),
        ({"rid": "\udfff"}, "field 'rid' must be a string of Unicode text"),
        ({"rid": None}, "field 'rid' has the wrong type (NoneType), expected str"),
        ({"tokens": "abc"}, "field 'tokens' has the wrong type (str), expected list"),
        ({"tokens": [1, 512]}, "field 'tokens' must hold integers in 0..511"),
        ({"tokens": []}, "field 'tokens' must hold at least one token"),
        ({"max_new": 0}, "field 'max_new' must be in 1.."),
        ({"max_new": 10**4000}, "field 'max_new' must be in 1.."),
        ({"max_new": 2.0}, "field 'max_new' has the wrong type (float), expected int"),
        ({"verify": "yes"}, "field 'verify' has the wrong type (str), expected bool"),
        ({"max_new": 32768 - 95}, "96 prompt tokens + max_new 32673 is over this node's limit of 32768"),
    ],
)
async def test_a_bad_field_is_answered_and_the_connection_goes_on(fields: dict[str, Any], named: str) -> None:
    async with nodes() as n:
        msg = {"op": "generate", "rid": "bad", "tokens": prompt(5), "max_new": 2, **fields}
        with pytest.raises(protocol.ProtocolError, match=re.escape(named)):
            await n.client.call(msg)
        await n.verified()  # on the same connection


async def test_a_prompt_over_prefills_token_limit_fails_its_request_only() -> None:
    """Prefill bounds the tokens of one request (its compute grows with them): a longer prompt is
    answered with the reason, which ends that request; the next one is served."""
    async with nodes(prefill_limits=Limits(max_tokens=100)) as n:
        with trio.fail_after(GUARD_S):
            reply, _ = await n.client.generate("long", prompt(9, 101), 1)
        assert (
            reply["outcome"] == "failed" and "101 tokens is over this node's limit of 100" in reply["reason"]
        )
        await n.verified()  # 96 tokens


async def test_a_bad_kv_field_is_answered_by_prefill() -> None:
    async with nodes() as n:
        kv = {"op": "kv", "tid": 7, "tokens": "x", "start": 0, "end": 0, "dst": []}
        stream, reader = await authenticated(n.prefill_port, n.prefill.secret)
        async with stream:
            await stream.send_all(n.hello() + protocol.encode(kv) + protocol.encode({**kv, "tid": 8}))
            with trio.fail_after(GUARD_S):
                replies = [(await reader.receive())[0] for _ in range(3)]  # the connection stays up
        assert replies[0]["op"] == "hello"
        assert sorted(r["tid"] for r in replies[1:]) == [7, 8]
        assert all(
            r["ok"] is False and "field 'tokens' has the wrong type" in r["reason"] for r in replies[1:]
        )


# ============================================================================ a stand-in prefill


KV_NOTIF = b"kv:{tid}"
HOSTILE_PREFILLS = {  # the notifications its WRITEs carry, and its answers to a `kv` request
    "nonsense-notifications": ([b"kv:nonsense", b"kv:-1", b"kv:" + b"9" * 5000, b"xyz"], [{"ok": False}]),
    "unhashable-tid": ([KV_NOTIF], [{"tid": [0]}]),
    "answered-thrice": ([KV_NOTIF], [{"ok": False, "reason": "x"}] * 3),
    "error": ([KV_NOTIF], [{"op": "error", "reason": "go away"}]),
    "bad-fields": ([KV_NOTIF], [{"ok": True, "digests": "x", "first_token": -1}]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_PREFILLS))
async def test_a_decode_node_survives_a_hostile_prefill(case: str) -> None:
    """A prefill node that answers nonsense, or sends notifications that name no transfer, fails
    the request (with a reason), not the decode node."""
    notifs, answers = HOSTILE_PREFILLS[case]
    model = TinyConfig()
    cfg = DecodeConfig(l1_pages=32, l2_pages=32, page_size=4, decode_reserve_tokens=4, transfer_retries=1)
    async with TcpEngine(name="fake-prefill") as fake, TcpEngine(name="decode") as engine:

        async def hostile(stream: trio.SocketStream) -> None:
            reader = protocol.FrameReader(stream, max_binary=0)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
                msg = await stand_in_hello(stream, reader)
                peer = await fake.add_peer(bytes.fromhex(msg["info"]))
                hello = {"op": "hello", "info": fake.local_info().hex(), "profile": msg.get("profile")}
                await protocol.send(stream, hello)
                while True:
                    msg, _ = await reader.receive()
                    tid = msg["tid"]
                    for notif in notifs:
                        notif = notif.replace(b"{tid}", str(tid).encode())
                        handle = await fake.post("WRITE", region, [], peer, "L1", [], notif)
                        await fake.wait(handle, timeout=GUARD_S)
                    # All at once: the node reads them without waiting in between.
                    await stream.send_all(
                        b"".join(protocol.encode({"op": "kv", "tid": tid, **a}) for a in answers)
                    )

        layout = layout_for(model, cfg.page_size)
        region = fake.register("staging", np.zeros((1, layout.page_bytes), dtype=np.uint8))
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, hostile, 0)
            service = DecodeService(
                cfg, TinyModel(model), layout, MemoryStore(layout), engine, transfer_timeout=2
            )
            port = await nursery.start(service.run, 0, ("127.0.0.1", listeners[0].socket.getsockname()[1]))
            client = await DecodeClient.connect("127.0.0.1", port)
            with trio.fail_after(GUARD_S):
                reply, _ = await client.generate("r", [1, 2, 3, 4, 5], 1)
                assert reply["outcome"] == "failed" and reply["reason"], reply
                assert (await client.stats())["arrived"] == 1
            await client.aclose()
            nursery.cancel_scope.cancel()


# ============================================================================ finding 5: time and memory


def test_limits_are_checked() -> None:
    for bad in ({"max_connections": 0}, {"frame_timeout_s": float("nan")}, {"idle_timeout_s": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Limits(**bad)


async def test_a_reader_cuts_off_a_stalled_frame_and_an_idle_connection(autojump_clock: Any) -> None:
    """Virtual time (trio's MockClock): a half-sent header and a half-sent body are cut off once
    the frame timeout has passed, silence once the idle timeout has, and not before."""
    for sent, error, text, limit in [
        (protocol.encode({"op": "x"})[:9], protocol.ProtocolError, "did not complete within 3 s", 3),
        (protocol.encode({"op": "x" * 50})[:40], protocol.ProtocolError, "did not complete within 3 s", 3),
        (b"", protocol.IdleTimeout, "no frame within 60 s", 60),
    ]:
        send, receive = trio.testing.memory_stream_one_way_pair()
        await send.send_all(sent)
        reader = protocol.FrameReader(receive, frame_timeout=3, idle_timeout=60)
        start = trio.current_time()
        with pytest.raises(error, match=text):
            await reader.receive()
        assert trio.current_time() - start == pytest.approx(limit)  # virtual seconds: when, not how fast


@pytest.mark.slow
@pytest.mark.parametrize("node", NODES)
async def test_stalled_frames_and_idle_connections_are_cut_off(
    node: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With small limits: a half-sent header, a half-sent body and a silent connection are each
    closed by the node with a reason; a verified request then succeeds (the client's own idle
    connection was closed too, with a goodbye, and it reconnected)."""
    caplog.set_level(logging.INFO)
    limits = Limits(frame_timeout_s=0.3, idle_timeout_s=0.6)
    async with nodes(limits, limits) as n:
        await n.verified()
        gate = n.gate(node)
        before = gate.connections
        stalled = [protocol.encode({"op": "stats"})[:10], frame(b'{"op": "sta', n_json=20), b""]
        replies = []
        async with trio.open_nursery() as nursery:
            for data in stalled:

                async def stall(data: bytes = data) -> None:
                    replies.append(await exchange(n.port(node), data, close=False))

                nursery.start_soon(stall)
        reasons = sorted(r[-1]["reason"] for r in replies)
        assert [r[-1]["op"] for r in replies].count("goodbye") == 1, replies
        assert sum("did not complete within 0.3 s" in r for r in reasons) == 2, reasons
        # A prefill node's peer that has not authenticated waits only the frame timeout.
        idle = "0.3" if node == "prefill" else "0.6"
        assert any(f"no frame within {idle} s" in r for r in reasons), reasons
        assert logged(caplog, node, "did not complete within 0.3 s")
        await n.verified()
        assert gate.connections <= before and gate.in_flight == 0


@pytest.mark.slow
async def test_connections_idle_past_the_timeout_are_closed_and_clients_reconnect(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both nodes close connections idle past the timeout with a `goodbye`: the client's (it
    sends its next request again on a new connection) and decode's control connection to
    prefill (the next transfer opens a new one). Neither costs a request."""
    caplog.set_level(logging.INFO)
    limits = Limits(idle_timeout_s=0.2)
    async with nodes(limits, limits) as n:
        for _ in range(3):
            await n.verified()
            with trio.fail_after(GUARD_S):  # both idle connections are closed
                while n.service.gate.connections or n.prefill.gate.connections:
                    await trio.sleep(0.01)
        assert logged_info(caplog, "decode", "no frame within 0.2 s")
        assert logged_info(caplog, "decode", "closed by prefill: no frame within 0.2 s")
        await assert_nothing_held(n.service, n.client)


def logged_info(caplog: pytest.LogCaptureFixture, node: str, text: str) -> bool:
    return any(r.name == f"hicache.runtime.{node}" and text in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("node", NODES)
async def test_frame_bytes_in_flight_are_capped(node: str, caplog: pytest.LogCaptureFixture) -> None:
    """Finding 5: 40 connections each announce 16 MiB and send 12 MiB of it, then wait. With the
    default cap of 64 MiB the node takes 4 of them and refuses the rest with a reason; this
    process's RSS grows by less than the cap plus `SLACK` (75-93 MiB measured; without the cap
    40 x 12 MiB = 480 MiB stay buffered), and a verified request succeeds while the 4 are held."""
    caplog.set_level(logging.INFO)
    limits = Limits()
    declared, sent, attackers = 16 * MiB, 12 * MiB, 40
    payload = frame(b" " * sent, n_json=declared)
    async with nodes(limits, limits) as n:
        await n.verified()
        gate = n.gate(node)
        base = rss()
        sends_over = trio.Semaphore(0)
        done = trio.Event()

        async def attack() -> None:
            # Authenticated peers (prefill: the cluster secret): the budget is theirs alone.
            stream, _ = await authenticated(n.port(node), n.prefill.secret if node == "prefill" else None)
            async with stream:
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(payload)  # a refused one is closed under it
                sends_over.release()
                await done.wait()

        with trio.fail_after(GUARD_S * 3):
            async with trio.open_nursery() as nursery:
                for _ in range(attackers):
                    nursery.start_soon(attack)
                for _ in range(attackers):
                    await sends_over.acquire()
                held = rss() - base
                assert held < limits.frame_bytes_in_flight + SLACK, f"RSS grew by {held / MiB:.0f} MiB"
                assert gate.refused_frames == attackers - 4
                assert gate.in_flight == 4 * declared and gate.peak_in_flight <= limits.frame_bytes_in_flight
                await n.verified()
                done.set()
        assert logged(caplog, node, f"frame of {declared} B refused")
        with trio.fail_after(GUARD_S):
            while gate.in_flight:  # the 4 hung up mid-frame: their bytes are released
                await trio.sleep(0.01)
        await n.verified()


@pytest.mark.parametrize("node", NODES)
async def test_unauthenticated_peers_hold_none_of_the_frame_budget(
    node: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30, finding 4: four 17-byte headers announcing 16 MiB each, from a process with
    neither the cluster secret (prefill) nor an API key (decode with --api-keys), reserved the
    whole 64 MiB budget for the frame timeout, renewably, and every frame over 64 KiB (a prompt
    above ~10k tokens) was refused meanwhile. Now each is refused at its header, nothing is
    reserved, and an authenticated peer's 1 MiB frame still goes through."""
    caplog.set_level(logging.INFO)
    limits = Limits(frame_timeout_s=30.0)
    keys = ApiKeys({digest(ADMIN_KEY): Principal(tenant=None, admin=True)})
    async with nodes(limits, limits, api_keys=keys if node == "decode" else None) as n:
        await n.verified()
        gate = n.gate(node)
        header = frame(b"", n_json=16 * MiB)[: struct.calcsize("<4sBIQ")]
        assert len(header) == 17
        streams = []
        for _ in range(4):
            stream = await trio.open_tcp_stream("127.0.0.1", n.port(node))
            await stream.send_all(header)
            streams.append(stream)
        with trio.fail_after(GUARD_S):  # each header is refused, or (before) reserved
            while gate.refused_frames + gate.in_flight // (16 * MiB) < 4:
                await trio.sleep(0.01)
        assert gate.in_flight == 0 and gate.peak_in_flight == 0
        assert gate.refused_unauthenticated == 4
        assert logged(caplog, node, "the peer is not authenticated yet")
        # An authenticated peer's large frame is read (and answered on its merits).
        if node == "prefill":
            big = {"op": "hello", "info": "zz", "pad": "x" * MiB}
            named = "bad field 'info'"
            replies = await exchange(n.port(node), protocol.encode(big), secret=n.prefill.secret)
        else:
            auth = protocol.encode({"op": "auth", "api_key": ADMIN_KEY})
            big = protocol.encode({"op": "nonsense", "pad": "x" * MiB})
            named = "unknown op 'nonsense'"
            replies = await exchange(n.port(node), auth + big)
        assert replies and named in replies[-1]["reason"], replies
        assert gate.peak_in_flight > MiB
        await n.verified()
        for stream in streams:
            await stream.aclose()


@pytest.mark.parametrize("node", NODES)
async def test_a_stranger_holds_a_connection_slot_no_longer_than_the_frame_timeout(node: str) -> None:
    """A connection that never authenticates is closed after the frame timeout of silence, not
    the idle timeout (600 s: 256 such connections held every slot for ten minutes); one that
    did authenticate stays through that silence."""
    limits = Limits(frame_timeout_s=0.3)
    keys = ApiKeys({digest(ADMIN_KEY): Principal(tenant=None, admin=True)})
    async with nodes(limits, limits, api_keys=keys if node == "decode" else None) as n:
        await n.verified()
        gate = n.gate(node)
        base = gate.connections
        stranger = await trio.open_tcp_stream("127.0.0.1", n.port(node))
        if node == "prefill":
            friend, _ = await authenticated(n.port(node), n.prefill.secret)
        else:
            friend = await trio.open_tcp_stream("127.0.0.1", n.port(node))
            await friend.send_all(protocol.encode({"op": "auth", "api_key": ADMIN_KEY}))
            got, _ = await protocol.FrameReader(friend, max_binary=0).receive()
            assert got["ok"] is True, got
        with trio.fail_after(GUARD_S):
            while gate.connections != base + 1:  # the stranger's slot is freed
                await trio.sleep(0.01)
        await trio.sleep(3 * limits.frame_timeout_s)
        assert gate.connections == base + 1  # the friend's is not
        await n.verified()
        for stream in (stranger, friend):
            await stream.aclose()


@pytest.mark.parametrize("node", NODES)
async def test_connections_beyond_the_cap_are_refused(node: str) -> None:
    """Busy connections (each inside a frame) fill the cap: a newcomer is refused, saying so.
    (A decode node first closes its client's connection, which waits between requests.)"""
    limits = Limits(max_connections=3)
    async with nodes(limits, limits) as n:
        gate = n.gate(node)
        streams = []
        # the node's own connection (decode: the client; prefill: decode's control), then busy ones
        while gate.connections < 3 or gate.waiting:
            streams.append(await trio.open_tcp_stream("127.0.0.1", n.port(node)))
            await streams[-1].send_all(protocol.encode({"op": "stats"})[:3])  # inside a frame: busy
            with trio.fail_after(GUARD_S):
                while gate.connections + gate.refused_connections + gate.evicted < len(streams) + 1:
                    await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()  # its bytes were read: it is busy, not waiting
            assert len(streams) < 10
        replies = await exchange(n.port(node), b"", close=False)
        assert len(replies) == 1 and "too many connections" in replies[0]["reason"], replies
        assert "busy" in replies[0]["reason"]
        for s in streams:
            await s.aclose()
        with trio.fail_after(GUARD_S):
            while gate.connections > 1:
                await trio.sleep(0.01)
        await n.verified()
        if node == "decode":
            (stats,) = await exchange(n.decode_port, protocol.encode({"op": "stats"}))
            assert stats["op"] == "stats"


@pytest.mark.parametrize("keys", [False, True], ids=["open", "api-keys"])
async def test_silent_connections_make_room_for_clients_at_the_cap(keys: bool) -> None:
    """Issue 30, finding 5: connections that send nothing held every slot, and the front door's
    next connection was refused ("refused the API key: too many connections"). Now a newcomer at
    the cap closes one waiting between requests, with a goodbye (one not authenticated first,
    else the longest idle), and a client gets through; a refusal says what it is."""
    limits = Limits(max_connections=4)
    api_keys = ApiKeys({digest(ADMIN_KEY): Principal(tenant=None, admin=True)}) if keys else None
    async with nodes(limits, limits, api_keys=api_keys) as n:
        gate = n.gate("decode")
        silent = []
        while gate.connections < 4:  # the client's own connection, then silent ones
            silent.append(await trio.open_tcp_stream("127.0.0.1", n.decode_port))
            with trio.fail_after(GUARD_S):
                while gate.connections < len(silent) + 1:
                    await trio.sleep(0.01)
            assert len(silent) < 10
        other = await DecodeClient.connect("127.0.0.1", n.decode_port, api_key=ADMIN_KEY if keys else None)
        try:
            (stats,) = [await other.call({"op": "stats"})]
            assert stats[0]["op"] == "stats", stats
        finally:
            await other.aclose()
        assert gate.evicted >= 1 and gate.refused_connections == 0
        if keys:  # an unauthenticated silent connection made the room, told why; the client's was kept
            reader = protocol.FrameReader(silent[0])
            with trio.fail_after(GUARD_S):
                goodbye, _ = await reader.receive()
            assert goodbye["op"] == "goodbye" and "make room" in goodbye["reason"], goodbye
        # Open, the longest idle went (the client's own): it sends its next request again.
        await n.verified()
        for s in silent:
            await s.aclose()


async def test_a_refused_connection_is_not_called_a_refused_key() -> None:
    """The client names a refusal for what it is (the node's reason), not an API key problem."""
    limits = Limits(max_connections=2)
    api_keys = ApiKeys({digest(ADMIN_KEY): Principal(tenant=None, admin=True)})
    async with nodes(limits, limits, api_keys=api_keys) as n:
        gate = n.gate("decode")
        busy = []
        while gate.connections < 2 or gate.waiting:  # the client's own waits: it makes room once
            busy.append(await trio.open_tcp_stream("127.0.0.1", n.decode_port))
            await busy[-1].send_all(protocol.encode({"op": "stats"})[:3])  # inside a frame: busy
            with trio.fail_after(GUARD_S):
                while gate.connections + gate.evicted < len(busy) + 1:
                    await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()  # its bytes were read: it is busy, not waiting
            assert len(busy) < 10
        with pytest.raises(
            protocol.ProtocolError, match="refused the connection: too many connections"
        ) as err:
            await DecodeClient.connect("127.0.0.1", n.decode_port, api_key=ADMIN_KEY)
        assert "API key" not in str(err.value)
        for b in busy:
            await b.aclose()


def rss() -> int:
    """This process's resident set, in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024  # type: ignore[union-attr]


# ============================================================================ any frames (hypothesis)


class NodesInThread:
    """Live nodes in a thread of their own (their own trio run), so that every hypothesis
    example talks to the same nodes over plain sockets; `call` runs a coroutine there."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.n: Nodes | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.stop: trio.Event | None = None
        self.error: BaseException | None = None
        self.base_rss = 0  # after the first verified request: model and pools are in memory
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by the test that uses the nodes
            self.error = exc
            self.ready.set()

    async def _main(self) -> None:
        async with nodes() as n:
            self.n, self.token, self.stop = n, trio.lowlevel.current_trio_token(), trio.Event()
            self.ready.set()
            await self.stop.wait()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def peek(self, fn: Callable[[], Any]) -> Any:
        return trio.from_thread.run_sync(fn, trio_token=self.token)


@pytest.fixture(scope="module")
def live() -> Iterator[NodesInThread]:
    nodes_ = NodesInThread()
    nodes_.thread.start()
    assert nodes_.ready.wait(GUARD_S * 3) and nodes_.error is None, nodes_.error
    nodes_.call(nodes_.n.verified)  # type: ignore[union-attr]
    nodes_.base_rss = rss()
    yield nodes_
    nodes_.peek(nodes_.stop.set)  # type: ignore[union-attr]
    nodes_.thread.join(GUARD_S)


SURROGATES = st.sampled_from(["\udc00", "a\ud800", "\udfff\udfff"]) | st.text(
    st.characters(categories=["Cs"]), min_size=1, max_size=3
)
VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 3, 511, 512, 2**31, 2**63, 2**64, 10**4299, -(10**4299)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    SURROGATES,
    st.booleans(),
    st.none(),
    st.lists(st.integers(-3, 600), max_size=5),
    st.lists(st.one_of(st.booleans(), st.floats(), st.text(max_size=2), SURROGATES), min_size=1, max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.integers(1, 600).map(lambda d: json.loads("[" * d + "]" * d)),  # deep, but it parses
)
FIELDS = {
    "decode": {
        "generate": ["rid", "tokens", "max_new", "tenant", "verify"],
        "evict": ["l1", "l2"],
        "stats": [],
        "audit": [],
        "idle": [],
    },
    "prefill": {"kv": ["tid", "tokens", "start", "end", "dst"], "cancel": ["tid"], "hello": ["info"]},
}
GOOD = {  # a valid value per field, so that most messages have only one or two bad fields
    "rid": st.text(max_size=4),
    "tokens": st.lists(st.integers(0, 511), min_size=1, max_size=40),
    "max_new": st.integers(1, 3),
    "tenant": st.text(max_size=3),
    "verify": st.booleans(),
    "l1": st.integers(0, 64),
    "l2": st.integers(0, 64),
    "tid": st.integers(0, 2**40),
    "start": st.just(0),
    "end": st.integers(0, 40),
    "dst": st.lists(st.integers(0, 7), max_size=3),
    "info": st.just("00"),
}


def parses(body: bytes) -> bool:
    """Whether `body` is the JSON of an object with a string op (what a node reads as a message)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("op"), str)


SOME_BODIES = [
    b"[" * 1000 + b"]" * 1000,
    b'{"op": "generate", "x": ' + b"[" * 100_000 + b"}",
    b'{"op": "kv", "tid": ' + b"9" * 4301 + b"}",
    b'{"op": "generate", "max_new": -' + b"9" * 5000 + b"}",
    b'{"op": "stats", "x": 1e400}',
    b'{"op": "stats", "x": -Infinity}',
    b'{"op": NaN}',
    b'{"op": "evict", "l1": Infinity}',
    b'{"op": "generate", "rid": "\\udc00", "tokens": [1], "max_new": NaN}',
    b'{"op": "\xff\xfe"}',
    b'"\\udc00"',
    b"[1, 2",
    b"{}",
    b'{"op": 5}',
    b"",
]
RAW_BODIES = st.sampled_from(SOME_BODIES) | st.binary(max_size=40)
PARSING_BODIES = st.sampled_from([b for b in SOME_BODIES if parses(b)])


@st.composite
def messages(draw: st.DrawFn, node: str) -> dict[str, Any]:
    """A message of the node's protocol with some fields bad, missing or extra."""
    op = draw(st.sampled_from(sorted(FIELDS[node])) | st.text(max_size=4) | SURROGATES)
    names = FIELDS[node].get(op, [])
    msg: dict[str, Any] = {"op": op}
    for name in names:
        msg[name] = draw(GOOD[name])
    for name in draw(st.lists(st.sampled_from(names + ["zz"]), max_size=2, unique=True)):
        if draw(st.booleans()):
            msg[name] = draw(VALUES)
        else:
            msg.pop(name, None)
    if op == "generate" and type(msg.get("max_new")) is int and msg["max_new"] > 3:
        msg["max_new"] = 3  # a valid request is served for real: keep it short
    return msg


@st.composite
def whole_frames(draw: st.DrawFn, node: str) -> tuple[bytes, bool]:
    """A frame the node reads whole: a message of its protocol (fields bad, missing or extra),
    or JSON that parses into one (infinities, NaN)."""
    if draw(st.integers(0, 5)):
        return protocol.encode(draw(messages(node))), True
    body = draw(PARSING_BODIES)
    return frame(body), True


@st.composite
def broken_frames(draw: st.DrawFn, node: str) -> tuple[bytes, bool]:
    """A frame that ends its connection: JSON that does not parse (deep, long numbers, bad
    UTF-8, anything), a lying header, or a frame cut short (the stream ends)."""
    kind = draw(st.sampled_from(["raw", "header", "cut"]))
    if kind == "raw":
        body = draw(RAW_BODIES)
        return frame(body), parses(body)
    if kind == "header":
        body = b'{"op": "stats"}'
        lie = draw(st.sampled_from(["magic", "version", "json", "binary"]))
        if lie == "magic":
            magic = draw(st.binary(min_size=4, max_size=4))
            return frame(body, magic=magic), magic == protocol.MAGIC
        if lie == "version":
            return struct.pack(
                "<4sBIQ", protocol.MAGIC, draw(st.integers(2, 255)), len(body), 0
            ) + body, False
        if lie == "json":
            return frame(body, n_json=draw(st.integers(protocol.MAX_JSON + 1, 2**32 - 1))), False
        return frame(body, n_bin=draw(st.integers(1, 2**64 - 1))), False
    whole = protocol.encode(draw(messages(node)))
    return whole[: draw(st.integers(1, len(whole) - 1))], False  # 0 bytes would be a clean end


@st.composite
def batches(draw: st.DrawFn, node: str) -> list[tuple[bytes, bool]]:
    """Up to 4 frames the node reads whole, then half the time one that ends the connection
    (nothing after it: what the node leaves unread would reset the connection, and the kernel
    may then drop the node's answer before the attacker reads it)."""
    batch = draw(st.lists(whole_frames(node), max_size=4))
    if draw(st.booleans()) or not batch:
        batch.append(draw(broken_frames(node)))
    return batch


@pytest.mark.slow
@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)
@given(data=st.data())
def test_any_frames_leave_live_nodes_serving(live: NodesInThread, data: st.DataObject) -> None:
    """Any batch of frames, to either node: every frame up to the first broken one is answered
    (a broken one with an error and a reason), nothing else happens to the node, and a verified
    request succeeds after the batch; the node holds no connection or frame byte of the batch
    afterwards, and this process's RSS stays within 256 MiB of where the run began."""
    n = live.n
    assert n is not None
    node = data.draw(st.sampled_from(NODES), label="node")
    batch = data.draw(batches(node), label="frames")
    broken = next((i for i, (_, ok) in enumerate(batch) if not ok), None)
    hello = node == "prefill" and data.draw(st.booleans(), label="valid hello first")
    gate = n.gate(node)
    before = live.peek(lambda: gate.connections)
    stream = n.hello() if hello else b""
    for raw, _ in batch:
        stream += raw
    # After the handshake when a hello comes first; else the first frame is read as the answer
    # to the node's challenge (its reply to `challenge` is in `replies`).
    replies = talk(n.port(node), stream, n.prefill.secret if hello else None)
    assert all(isinstance(r.get("op"), str) for r in replies), replies
    if node == "decode":
        answered = len(batch) if broken is None else broken + 1
        assert len(replies) == answered, (replies, batch)
        event("decode: " + ("broken frame" if broken is not None else "whole frames"))
    else:
        event(
            f"prefill: {'hello, ' if hello else ''}{'broken frame' if broken is not None else 'whole frames'}"
        )
    if broken is not None or (node == "prefill" and not hello):
        last = replies[-1] if replies else {}
        assert last.get("op") == "error" and isinstance(last.get("reason"), str) and last["reason"], replies
    errors = [r for r in replies if r["op"] == "error"]
    assert all(isinstance(r.get("reason"), str) and r["reason"] for r in errors), errors
    live.call(n.verified)
    assert live.peek(lambda: (gate.connections, gate.in_flight)) == (before, 0)
    assert rss() - live.base_rss < 256 * MiB


def talk(port: int, data: bytes, secret: ClusterSecret | None = None) -> list[dict[str, Any]]:
    """Plain sockets (the nodes live in another thread): send, half-close, read to the end."""
    if secret is not None:
        sock = authenticated_socket(port, secret)
    else:
        sock = socket.create_connection(("127.0.0.1", port), timeout=GUARD_S)
    with sock:
        # The node may have closed already (a refused frame): a broken pipe, a reset, or a
        # half-close of a connection that is gone (ENOTCONN). Its replies are read below.
        with contextlib.suppress(OSError):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    replies = []
    while len(received) >= protocol.HEADER_SIZE:
        _, _, n_json, n_bin = struct.unpack("<4sBIQ", received[: protocol.HEADER_SIZE])
        end = protocol.HEADER_SIZE + n_json + n_bin
        replies.append(json.loads(received[protocol.HEADER_SIZE : protocol.HEADER_SIZE + n_json]))
        received = received[end:]
    assert received == b"", "a reply frame was cut short"
    return replies


_JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    timing=_JSONISH | st.fixed_dictionaries({"wait_s": _JSONISH, "compute_s": _JSONISH}),
    before=st.floats(-1.0, 100.0),
    exchange=st.floats(0.0, 100.0),
)
def test_prefill_s_timing_is_a_peer_s_word_and_never_breaks_a_request_s_phases(
    timing: Any, before: float, exchange: float
) -> None:
    """Whatever prefill says of its wait and compute, the request's phases are non-negative finite
    seconds that never exceed the exchange they split (prefill's parts are taken only where they
    fit in it), and the decode node's own wait is its own measure."""
    import math

    from hicache.runtime.decode.transfers import ROUNDING_S, _phases

    got = _phases(timing, before, exchange)
    assert set(got) in (
        {"decode_wait_s", "transfer_s"},
        {"decode_wait_s", "prefill_wait_s", "prefill_compute_s", "transfer_s"},
    )
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in got.values())
    assert got["decode_wait_s"] == pytest.approx(max(0.0, before), abs=1e-6)
    split = got.get("prefill_wait_s", 0.0) + got.get("prefill_compute_s", 0.0) + got["transfer_s"]
    assert split <= exchange + ROUNDING_S + 1e-5
    if "prefill_wait_s" not in got:
        assert got["transfer_s"] == pytest.approx(exchange, abs=1e-6)
