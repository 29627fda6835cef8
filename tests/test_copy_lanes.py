"""The copy engine's device path on lanes (`runtime/kv/copy_lanes.py`), run on host memory: the
pools named `dev*` stand for device pools, and their copies go through the same issue, event and
host-scatter steps as on a GPU, on an `ImmediateLane` (every event already fired) or on a lane
whose events fire only when the test says so, which shows the ordering: nothing is vouched for,
no host page written from the device and no staging buffer reused before the copy's event."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import trio
import trio.testing
from builders import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.runtime.kv.copy_engine import CopyEngine
from hicache.runtime.kv.copy_lanes import ImmediateLane
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool

LAYOUT = KVLayout(2, 2, 8, 2, "bfloat16")


def on_lane(pool: KVPool) -> bool:
    return pool.name.startswith("dev")


def filled(name: str, pages: int, seed: int, layout: KVLayout = LAYOUT) -> KVPool:
    pool = KVPool(layout, pages, name=name)
    rng = np.random.default_rng(seed)
    pool.bytes_view().copy_(torch.from_numpy(rng.integers(0, 256, tuple(pool.bytes_view().shape), np.uint8)))
    return pool


def pages(pool: KVPool) -> np.ndarray:
    return pool.bytes_view().numpy().copy()


class Gate:
    """An event that fires when the test opens it."""

    def __init__(self) -> None:
        self.open = False

    def query(self) -> bool:
        return self.open


class GatedLane(ImmediateLane):
    """Operations run as issued, but each recorded event fires only once the test opens it."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.events: list[Gate] = []
        self.callers: list[object] = []

    @contextlib.contextmanager
    def issuing(self, caller: object) -> Iterator[None]:
        self.callers.append(caller)
        yield

    def record(self) -> Gate:
        self.events.append(Gate())
        return self.events[-1]


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    direction=st.sampled_from(["h2d", "d2h", "d2d"]),
    by_runs=st.booleans(),
    count=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
async def test_every_direction_on_a_lane_is_bit_exact_and_touches_only_its_pages(
    direction: str, by_runs: bool, count: int, seed: int, data: st.DataObject
) -> None:
    host, dev = filled("host", 16, seed), filled("dev", 16, seed + 1)
    src, dst = {"h2d": (host, dev), "d2h": (dev, host), "d2d": (dev, dev)}[direction]
    if src is dst:  # within one pool: sources and destinations apart
        order = data.draw(st.permutations(range(16)))
        src_pages, dst_pages = order[:count] if count <= 8 else order[:8], order[8 : 8 + min(count, 8)]
    else:
        src_pages = data.draw(st.lists(st.integers(0, 15), min_size=count, max_size=count))
        dst_pages = data.draw(st.permutations(range(16)))[:count]
    before_src, before_dst = pages(src), pages(dst)
    engine = CopyEngine(large_page_bytes=0 if by_runs else 1 << 62, on_lane=on_lane, lanes=ImmediateLane)
    await engine.copy(src, src_pages, dst, dst_pages)
    want = before_dst.copy()
    want[dst_pages] = before_src[src_pages]
    assert np.array_equal(pages(dst), want)
    if src is not dst:
        assert np.array_equal(pages(src), before_src)
    # Staging buffers are reused: a second copy of the same size allocates none.
    allocs = engine.stats.staging_allocs
    await engine.copy(src, src_pages, dst, dst_pages)
    assert engine.stats.staging_allocs == allocs


async def test_a_copy_from_the_device_lands_on_the_host_only_after_its_event() -> None:
    dev, host = filled("dev", 8, 1), filled("host", 8, 2)
    lane = GatedLane()
    engine = CopyEngine(large_page_bytes=1 << 62, on_lane=on_lane, lanes=lambda device: lane)
    before, src = pages(host), pages(dev)
    done = trio.Event()

    async def copy(task_status: trio.TaskStatus[None]) -> None:
        await engine.copy(dev, [5, 1, 6], host, [0, 7, 3], task_status=task_status)
        done.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(copy)  # issued: the event is recorded, nothing is vouched for yet
        assert lane.events and lane.callers == [None]
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        assert np.array_equal(pages(host), before)  # the host scatter waits for the device's copy
        assert engine._staging and not any(engine._staging.values())  # noqa: SLF001  both buffers held
        lane.events[0].open = True
    assert done.is_set()
    want = before.copy()
    want[[0, 7, 3]] = src[[5, 1, 6]]
    assert np.array_equal(pages(host), want)
    assert sum(len(v) for v in engine._staging.values()) == 2  # noqa: SLF001  given back


async def test_a_cancelled_copy_returns_only_once_its_event_fired() -> None:
    host, dev = filled("host", 8, 3), filled("dev", 8, 4)
    lane = GatedLane()
    engine = CopyEngine(large_page_bytes=1 << 62, on_lane=on_lane, lanes=lambda device: lane)
    returned = trio.Event()

    async def copy(task_status: trio.TaskStatus[None]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await engine.copy(host, [0, 1], dev, [2, 3])
        returned.set()

    async with trio.open_nursery() as nursery:
        scope = await nursery.start(copy)
        while not lane.events:  # issued on a worker thread
            await trio.sleep(0.001)
        scope.cancel()
        await trio.sleep(0.05)  # the engine polls the event meanwhile
        assert not returned.is_set()  # the device still owns the pages
        lane.events[0].open = True
    assert returned.is_set()


async def test_events_of_one_lane_are_waited_for_in_order() -> None:
    host, dev = filled("host", 8, 5), filled("dev", 8, 6)
    lane = GatedLane()
    engine = CopyEngine(on_lane=on_lane, lanes=lambda device: lane)
    finished: list[int] = []

    async def copy(i: int, task_status: trio.TaskStatus[None]) -> None:
        await engine.copy(host, [i], dev, [i], task_status=task_status)
        finished.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            await nursery.start(copy, i)
        lane.events[1].open = True  # the second fired, but the first has not
        await trio.testing.wait_all_tasks_blocked()
        assert finished == []
        lane.events[0].open = True
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.01)
        assert finished == [0, 1]
        lane.events[2].open = True
    assert finished == [0, 1, 2]


@pytest.mark.gpu
async def test_the_cuda_lane_waits_for_the_callers_stream() -> None:
    """A page the caller's stream is still writing is copied as written (the lane waits)."""
    dev = KVPool(LAYOUT, 8, device="cuda", name="l1")
    host = KVPool(LAYOUT, 8, name="l2")
    engine = CopyEngine(large_page_bytes=1 << 62)
    torch.cuda._sleep(50_000_000)  # keep the caller's stream busy  # noqa: SLF001
    dev.words_view()[3].fill_(7)  # queued behind the sleep on the caller's stream
    await engine.copy(dev, [3], host, [0])
    assert bool((host.words_view()[0] == 7).all())
