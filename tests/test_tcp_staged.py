"""Staged TCP regions: device memory (a decode node's L1 pool on its GPU) served through host
staging buffers, driven here with host tensors registered `staged=True` (the same code path).

Pages land bit-exactly and only on the pages named (or the span named), a READ returns the right
bytes, the ACK and the notification come only once the copy into the region completed, a WRITE
that is fenced or broken copies nothing in, staging buffers are reused, and a staged region
behaves like an unstaged one. One test does the same with CUDA tensors where a GPU is present.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import trio
from builders import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transfer_peer import read_reply, wire_initiate

from hicache.runtime.transfer import MemoryRegion, PeerInfo, TcpEngine, XferState, tcp_wire
from hicache.runtime.transfer.base import Op, Span
from hicache.runtime.transfer.tcp_wire import Msg, Staging, encode_header

PAGES, PAGE_BYTES = 8, 512
GUARD_S = 10  # a guard against hangs, never a speed assertion


@attrs.define
class Pair:
    """Engines `a` and `b`, each with an unstaged pool "plain" and a staged pool "staged" whose
    contents start equal."""

    a: TcpEngine
    b: TcpEngine
    pools: dict[tuple[str, str], torch.Tensor]
    regions: dict[tuple[str, str], MemoryRegion]

    def pool(self, engine: str, name: str) -> torch.Tensor:
        return self.pools[engine, name]

    def region(self, engine: str, name: str) -> MemoryRegion:
        return self.regions[engine, name]


def random_pool(rng: np.random.Generator, pages: int = PAGES, page_bytes: int = PAGE_BYTES) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, (pages, page_bytes), dtype=np.uint8))


@contextlib.asynccontextmanager
async def pair(seed: int = 0, device: str = "cpu", **kwargs: Any) -> AsyncIterator[Pair]:
    rng = np.random.default_rng(seed)
    pools: dict[tuple[str, str], torch.Tensor] = {}
    regions: dict[tuple[str, str], MemoryRegion] = {}
    async with TcpEngine(name="a", **kwargs) as a, TcpEngine(name="b", **kwargs) as b:
        for engine in (a, b):
            start = random_pool(rng)
            pools[engine.name, "plain"] = start.clone()
            pools[engine.name, "staged"] = start.clone().to(device)
            regions[engine.name, "plain"] = engine.register("plain", pools[engine.name, "plain"])
            regions[engine.name, "staged"] = engine.register(
                "staged", pools[engine.name, "staged"], staged=True
            )
        await a.add_peer(b.local_info())
        await b.add_peer(a.local_info())
        yield Pair(a, b, pools, regions)


async def run(p: Pair, op: Op, local: str, lp: list[int], remote: str, rp: list[int], **kw: Any) -> None:
    """Post one transfer from `a` and check it ends DONE with its notification delivered."""
    notif = f"{op} {local}->{remote} {lp}->{rp}".encode()
    with trio.fail_after(GUARD_S):
        h = await p.a.post(op, p.region("a", local), lp, "b", remote, rp, notif, **kw)
        assert await p.a.wait(h, timeout=GUARD_S) is XferState.DONE, p.a.reason(h)
        assert await p.b.next_notif() == ("a", notif)
    p.a.release(h)


async def moved(
    p: Pair, op: Op, local: str, lp: list[int], remote: str, rp: list[int], span: Span | None = None
) -> None:
    """`run` one transfer and check the destination pool: exactly the pages (or the span of them)
    named hold the source's bytes, and nothing else changed."""
    a_pages, b_pages = (lp, rp) if op == "WRITE" else (rp, lp)
    src = p.pool("a", local) if op == "WRITE" else p.pool("b", remote)
    dst = p.pool("b", remote) if op == "WRITE" else p.pool("a", local)
    cols = slice(None) if span is None else slice(span.offset, span.offset + span.length)
    expected = dst.clone()
    expected[b_pages, cols] = src[a_pages, cols]
    await run(p, op, local, lp, remote, rp, **({} if span is None else {"span": span}))
    assert torch.equal(dst, expected)


def cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


# ---------------------------------------------------------------------------------------------
# Pages land exactly where they are sent


async def test_a_write_into_a_staged_region_lands_exactly_and_only_on_its_pages() -> None:
    async with pair(1) as p:
        await moved(p, "WRITE", "plain", [5, 0, 3], "staged", [2, 7, 4])  # 7 then 4: not one run
        assert p.b.staging_allocations(p.region("b", "staged")) == 1


async def test_a_write_span_into_a_staged_region_lands_only_its_span(monkeypatch: pytest.MonkeyPatch) -> None:
    # A span's copy is cut into pieces of at most two pages' spans (pages 3 and 4, then 5 and 0).
    monkeypatch.setattr(tcp_wire, "SPAN_SCRATCH_BYTES", 2 * 200)
    async with pair(2) as p:
        await moved(p, "WRITE", "plain", [1, 2, 7, 6], "staged", [3, 4, 5, 0], Span(100, 200))


async def test_a_write_span_from_a_staged_region_sends_only_its_span() -> None:
    async with pair(3) as p:
        await moved(p, "WRITE", "staged", [7, 1], "plain", [0, 5], Span(0, 64))


async def test_a_read_from_a_staged_region_returns_its_pages_in_order() -> None:
    async with pair(4) as p:
        await moved(p, "READ", "plain", [0, 1, 2, 3], "staged", [6, 5, 1, 2])


async def test_a_read_into_a_staged_region_lands_exactly_and_only_on_its_pages() -> None:
    async with pair(5) as p:
        await moved(p, "READ", "staged", [4, 2], "plain", [3, 4])


async def test_staged_is_chosen_by_where_the_tensor_lives_unless_asked_for() -> None:
    async with TcpEngine(name="solo") as e:
        host = e.register("host", torch.zeros(PAGES, PAGE_BYTES, dtype=torch.uint8))
        forced = e.register("forced", np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8), staged=True)
        assert (host.mem_type, forced.mem_type) == ("DRAM", "DRAM")
        assert e._regions["host"].staging is None and e._regions["host"].pages is not None
        assert e._regions["forced"].staging is not None and e._regions["forced"].pages is None
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8)
            ro.setflags(write=False)
            e.register("ro", ro, staged=True)


# ---------------------------------------------------------------------------------------------
# Nothing is vouched for before the bytes are in the region


@pytest.mark.parametrize("op", ["WRITE", "READ"])
async def test_the_ack_and_the_notification_wait_for_the_copy_into_the_region(
    op: Op, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Staging.scatter
    copies: list[str] = []

    async def slow_scatter(self: Staging, buf: torch.Tensor, idx: np.ndarray, span: Span | None) -> None:
        copies.append("started")
        await trio.sleep(0.2)  # a copy to the device that takes a while
        await original(self, buf, idx, span)
        copies.append("done")

    monkeypatch.setattr(Staging, "scatter", slow_scatter)
    async with pair(6) as p:
        # WRITE: a's plain pool into b's staged one; READ: b's plain pool into a's staged one.
        src, dst = (p.pool("a", "plain"), p.pool("b", "staged"))
        if op == "READ":
            src, dst = p.pool("b", "plain"), p.pool("a", "staged")
        lp, rp = [0, 1, 2, 6], [7, 3, 4, 5]
        expected = dst.clone()
        if op == "WRITE":
            expected[rp] = src[lp]
        else:
            expected[lp] = src[rp]
        local, remote = ("plain", "staged") if op == "WRITE" else ("staged", "plain")
        seen: dict[str, bool] = {}

        async def on_done(handle: Any) -> None:
            assert await p.a.wait(handle, timeout=GUARD_S) is XferState.DONE
            seen["done"] = torch.equal(dst, expected)

        with trio.fail_after(GUARD_S):
            h = await p.a.post(op, p.region("a", local), lp, "b", remote, rp, b"here")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(on_done, h)
                assert await p.b.next_notif() == ("a", b"here")
                seen["notif"] = torch.equal(dst, expected)
        assert seen == {"done": True, "notif": True}
        assert copies == ["started", "done"]


# ---------------------------------------------------------------------------------------------
# A WRITE given up on copies nothing in


async def raw_write(engine: TcpEngine, dst: list[int], notif: bytes) -> trio.SocketStream:
    """A connection to `engine` as known peer "prefill" that has sent a WRITE's header to region
    "staged" and no page bytes yet."""
    fields = {"host": b"127.0.0.1", "port": (9).to_bytes(2, "little")}
    await engine.add_peer(PeerInfo("tcp", "prefill", fields, ()).encode())
    stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
    await wire_initiate(stream, b"prefill")
    head = encode_header(Msg.WRITE, 1, b"staged", len(dst), PAGE_BYTES, len(notif))
    await stream.send_all(head + struct.pack(f"<{len(dst)}I", *dst) + notif)
    return stream


async def landing(engine: TcpEngine, region: MemoryRegion) -> None:
    """Wait until a WRITE into `region` has its staging buffer (it is receiving pages)."""
    while engine.staging_allocations(region) == 0:
        await trio.sleep(0.005)
    await trio.sleep(0.05)  # the bytes sent so far are read into it


async def test_a_write_fenced_while_landing_leaves_the_staged_region_untouched() -> None:
    data = np.random.default_rng(7).integers(1, 256, (4, PAGE_BYTES), dtype=np.uint8)
    pool = torch.zeros(PAGES, PAGE_BYTES, dtype=torch.uint8)
    async with TcpEngine(name="target") as engine:
        region = engine.register("staged", pool, staged=True)
        with trio.fail_after(GUARD_S):
            stream = await raw_write(engine, [5, 1, 6, 2], b"kv:7")
            await stream.send_all(data[:2].tobytes() + data[2, : PAGE_BYTES // 2].tobytes())
            await landing(engine, region)
            assert await engine.fence(b"kv:7") is True
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(data[2, PAGE_BYTES // 2 :].tobytes() + data[3].tobytes())
            mtype, text = await read_reply(stream)
            await stream.aclose()
        assert engine.notifs() == []
    assert mtype == Msg.ERROR and b"fenced while landing" in text
    assert not pool.any()  # not one byte: the staging buffer was dropped


async def test_a_write_fenced_while_it_is_copied_in_is_refused_and_the_fence_waits_for_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = Staging.scatter
    copying, copied = trio.Event(), trio.Event()

    async def slow_scatter(self: Staging, buf: torch.Tensor, idx: np.ndarray, span: Span | None) -> None:
        copying.set()
        await trio.sleep(0.2)
        await original(self, buf, idx, span)
        copied.set()

    monkeypatch.setattr(Staging, "scatter", slow_scatter)
    async with pair(8) as p:
        with trio.fail_after(GUARD_S):
            h = await p.a.post("WRITE", p.region("a", "plain"), [0, 1], "b", "staged", [2, 3], b"kv:8")
            await copying.wait()
            assert await p.b.fence(b"kv:8") is True
            assert copied.is_set()  # the fence returned only once nothing more could land
            assert await p.a.wait(h, timeout=GUARD_S) is XferState.ERR
        assert "fenced while landing" in (p.a.reason(h) or "")
        await trio.sleep(0.05)
        assert p.b.notifs() == []


async def test_a_write_whose_connection_breaks_leaves_the_staged_region_untouched() -> None:
    data = np.random.default_rng(9).integers(1, 256, (3, PAGE_BYTES), dtype=np.uint8)
    pool = torch.zeros(PAGES, PAGE_BYTES, dtype=torch.uint8)
    async with TcpEngine(name="target") as engine:
        region = engine.register("staged", pool, staged=True)
        with trio.fail_after(GUARD_S):
            stream = await raw_write(engine, [0, 1, 2], b"kv:9")
            await stream.send_all(data[:2].tobytes())
            await landing(engine, region)
            await stream.aclose()
            await trio.sleep(0.1)
        assert engine.notifs() == []
    assert not pool.any()


# ---------------------------------------------------------------------------------------------
# Staging buffers are reused


async def test_staging_buffers_are_reused_and_grow_only_when_a_bigger_one_is_needed() -> None:
    async with pair(10) as p:
        staged = p.region("b", "staged")
        for i in range(5):
            await run(p, "WRITE", "plain", [i, i + 1], "staged", [i + 1, i])
        assert p.b.staging_allocations(staged) == 1
        await run(p, "WRITE", "plain", [0, 1, 2, 3], "staged", [4, 5, 6, 7])
        assert p.b.staging_allocations(staged) == 2
        await run(p, "READ", "plain", [0, 1, 2], "staged", [1, 2, 3])
        await run(p, "WRITE", "plain", [0, 1, 2, 3], "staged", [0, 1, 2, 3], span=Span(8, 16))
        assert p.b.staging_allocations(staged) == 2
        kept = p.b._regions["staged"].staging
        assert kept is not None and kept.kept_bytes <= staged.nbytes


def test_free_staging_buffers_are_bounded() -> None:
    region = MemoryRegion("s", 0, 100, 4)
    staging = Staging(torch.zeros(4, 100, dtype=torch.uint8), region, keep_bytes=300)
    bufs = [staging.take(n) for n in (100, 200, 300)]
    assert staging.allocations == 3
    for buf in bufs:
        staging.give(buf)
    assert staging.kept_bytes == 300  # the biggest is kept, the smaller ones dropped
    assert staging.take(150).numel() == 300 and staging.allocations == 3


# ---------------------------------------------------------------------------------------------
# A staged region behaves like an unstaged one

OPS = st.sampled_from(["WRITE", "WRITE_SPAN", "READ"])


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
async def test_a_staged_region_and_an_unstaged_one_end_up_the_same(data: Any) -> None:
    async with pair(data.draw(st.integers(0, 2**16), label="seed")) as p:
        for _ in range(data.draw(st.integers(1, 4), label="transfers")):
            op = data.draw(OPS, label="op")
            k = data.draw(st.integers(0, PAGES), label="pages")
            lp = data.draw(st.permutations(range(PAGES)), label="local")[:k]
            rp = data.draw(st.permutations(range(PAGES)), label="remote")[:k]
            kw: dict[str, Any] = {}
            if op == "WRITE_SPAN":
                lo = data.draw(st.integers(0, PAGE_BYTES - 1), label="lo")
                hi = data.draw(st.integers(lo + 1, PAGE_BYTES), label="hi")
                kw["span"] = Span(lo, hi - lo)
            for kind in ("plain", "staged"):
                await run(p, "READ" if op == "READ" else "WRITE", kind, lp, kind, rp, **kw)
            for engine in ("a", "b"):
                assert torch.equal(p.pool(engine, "plain"), p.pool(engine, "staged")), (op, engine)


# ---------------------------------------------------------------------------------------------
# A real device


@pytest.mark.gpu
async def test_cuda_regions_are_staged_and_move_pages_exactly() -> None:
    async with pair(11, device="cuda") as p:
        dev = torch.zeros(PAGES, PAGE_BYTES // 2, dtype=torch.bfloat16, device="cuda")
        auto = p.b.register("auto", dev)  # a CUDA tensor is staged without being asked
        assert (auto.mem_type, auto.device, auto.page_bytes) == ("VRAM", 0, PAGE_BYTES)
        assert p.region("b", "staged").mem_type == "VRAM"
        steps: list[tuple[Op, list[int], list[int], dict[str, Any]]] = [
            ("WRITE", [5, 0, 3], [2, 7, 4], {}),
            ("WRITE", [1, 2, 6], [3, 4, 0], {"span": Span(100, 200)}),
            ("READ", [0, 1, 2, 3], [6, 5, 1, 2], {}),
            ("READ", [7, 6], [0, 1], {}),
        ]
        for op, lp, rp, kw in steps:
            for kind in ("plain", "staged"):
                await run(p, op, kind, lp, kind, rp, **kw)
            for engine in ("a", "b"):
                assert torch.equal(p.pool(engine, "plain"), cpu(p.pool(engine, "staged"))), (op, engine)
        src = p.pool("a", "plain")
        await run(p, "WRITE", "plain", [0, 1, 2, 3], "auto", [4, 5, 6, 7])
        assert torch.equal(cpu(dev).view(torch.uint8)[4:], src[:4])
        assert not cpu(dev)[:4].view(torch.uint8).any()
        assert p.b.staging_allocations(auto) == 1
