"""KV layouts, pools and the batched copy engine on real torch tensors."""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import pytest
import torch
import trio
import trio.testing
from builders import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.runtime.kv.copy_engine import CopyEngine, StreamTracker, contiguous_runs
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool

CUDA = torch.cuda.is_available()
DTYPES = ["float64", "float32", "bfloat16", "float16", "int8", "uint8"]

small_layouts = st.builds(
    KVLayout,
    layers=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([8, 16, 24]),
    page_size=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
)


def fill_random(pool: KVPool, seed: int) -> None:
    rows = pool.bytes_view()
    data = np.random.default_rng(seed).integers(0, 256, size=tuple(rows.shape), dtype=np.uint8)
    rows.copy_(torch.from_numpy(data))


def page_bytes_of(pool: KVPool) -> np.ndarray:
    return pool.bytes_view().cpu().numpy().copy()


# ------------------------------------------------------------------------------------- layout


@given(small_layouts)
def test_page_geometry(layout: KVLayout) -> None:
    assert layout.page_shape == (layout.layers, 2, layout.page_size, layout.kv_heads, layout.head_dim)
    assert layout.page_elems == math.prod(layout.page_shape)
    assert layout.page_bytes == layout.page_elems * torch.empty(0, dtype=layout.torch_dtype).element_size()
    assert layout.page_words * 8 == layout.page_bytes
    assert layout.token_bytes * layout.page_size == layout.page_bytes


def test_llama_like_page_is_8_mib() -> None:
    layout = KVLayout(layers=32, kv_heads=8, head_dim=128, page_size=64, dtype="bfloat16")
    assert layout.page_bytes == 32 * 2 * 64 * 8 * 128 * 2 == 8 << 20


def test_dtype_aliases_name_one_layout() -> None:
    assert KVLayout(1, 1, 8, 1, "float") == KVLayout(1, 1, 8, 1, "float32")
    assert KVLayout(1, 1, 8, 1, "half").dtype == "float16"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"head_dim": 3, "dtype": "float16"}, "not a multiple of 8"),
        ({"dtype": "nope"}, "'nope' is not a torch dtype"),
        ({"dtype": "Tensor"}, "'Tensor' is not a torch dtype"),
        ({"dtype": "qint8"}, "not a plain"),
        ({"layers": 0}, "KVLayout.layers"),
        ({"page_size": True}, "KVLayout.page_size"),
        ({"kv_heads": 2.0}, "KVLayout.kv_heads"),
    ],
)
def test_bad_layouts_are_rejected(kwargs: dict[str, object], needle: str) -> None:
    fields: dict[str, object] = {
        "layers": 1,
        "kv_heads": 1,
        "head_dim": 8,
        "page_size": 1,
        "dtype": "float32",
    }
    with pytest.raises(ValueError, match=needle):
        KVLayout(**(fields | kwargs))


# --------------------------------------------------------------------------------------- pools


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_lazy_pool_is_zeroed_and_holds_memory_only_where_written() -> None:
    layout = KVLayout(4, 2, 64, 16, "bfloat16")  # 32 KiB pages
    before = _rss()
    pool = KVPool(layout, 2048, name="L2", lazy=True)  # 64 MiB
    assert _rss() - before < 8 << 20  # nothing touched yet
    assert not pool.data.any()  # zeros everywhere (reading maps the shared zero page)
    assert pool.bytes_view().data_ptr() == pool.data.data_ptr() == pool.words_view().data_ptr()
    pool.data[:1024].fill_(1.0)
    assert _rss() - before >= 30 << 20  # the half written is held
    assert (pool.data[:1024] == 1).all() and not pool.data[1024:].any()


def test_views_share_storage_and_pages_are_prefaulted() -> None:
    layout = KVLayout(2, 2, 8, 4, "bfloat16")
    pool = KVPool(layout, 5, name="l2")
    assert pool.data.shape == (5, *layout.page_shape)
    assert pool.bytes_view().shape == (5, layout.page_bytes) and pool.bytes_view().dtype == torch.uint8
    assert pool.words_view().shape == (5, layout.page_bytes // 8) and pool.words_view().dtype == torch.int64
    assert pool.nbytes == 5 * layout.page_bytes == pool.data.numel() * pool.data.element_size()
    assert not pool.data.any()
    ptr = pool.data.data_ptr()
    assert pool.bytes_view().data_ptr() == ptr == pool.words_view().data_ptr()

    pool.words_view()[3, 0] = -1  # all ones in the first 8 bytes of page 3
    assert pool.bytes_view()[3, :8].tolist() == [255] * 8
    assert pool.page(3).flatten().view(torch.int16)[:4].tolist() == [-1] * 4
    pool.page(1).fill_(1.5)
    assert (pool.data[1] == 1.5).all() and not pool.data[0].any() and not pool.data[2].any()


def test_unpinned_host_pool_without_cuda() -> None:
    layout = KVLayout(1, 1, 8, 1, "float32")
    assert KVPool(layout, 2).pinned is CUDA
    if not CUDA:
        with pytest.raises(ValueError, match="pinning host memory needs CUDA"):
            KVPool(layout, 2, pinned=True)
        with pytest.raises(ValueError, match="sees no CUDA device"):
            KVPool(layout, 2, device="cuda")
    with pytest.raises(ValueError, match="expected 'cpu' or 'cuda'"):
        KVPool(layout, 2, device="meta")
    with pytest.raises(ValueError, match="num_pages"):
        KVPool(layout, 0)


@pytest.mark.parametrize(
    ("pages", "error", "needle"),
    [
        ([0, 4], IndexError, r"pages\[1\] = 4 out of range \[0, 4\)"),
        ([-1], IndexError, r"pages\[0\] = -1 out of range"),
        ([0.5, 1.0], TypeError, "1-D sequence of ints"),
        (np.array([True, False]), TypeError, "1-D sequence of ints"),
        (np.zeros((2, 2), dtype=np.int64), TypeError, "1-D sequence of ints"),
        (["1"], TypeError, "1-D sequence of ints"),
    ],
)
def test_index_validation(pages: object, error: type[Exception], needle: str) -> None:
    pool = KVPool(KVLayout(1, 1, 8, 1, "float32"), 4, name="p")
    with pytest.raises(error, match=needle):
        pool.indices(pages)  # type: ignore[arg-type]


def test_index_forms_and_duplicates() -> None:
    pool = KVPool(KVLayout(1, 1, 8, 1, "float32"), 4, name="p")
    for form in ([3, 1], (3, 1), np.array([3, 1], dtype=np.uint8), torch.tensor([3, 1])):
        assert pool.indices(form).tolist() == [3, 1]
    assert pool.indices([]).dtype == np.int64
    assert pool.indices([2, 2]).tolist() == [2, 2]
    with pytest.raises(ValueError, match="repeats page 2"):
        pool.indices([2, 0, 2], distinct=True)
    with pytest.raises(IndexError, match=r"page 4 out of range"):
        pool.page(4)
    with pytest.raises(TypeError, match="must be an int"):
        pool.page(True)


# -------------------------------------------------------------------------------------- copies


def test_contiguous_runs_merge_only_where_both_sides_continue() -> None:
    src = np.array([4, 5, 6, 9, 10, 2])
    dst = np.array([0, 1, 7, 8, 9, 3])
    assert contiguous_runs(src, dst).tolist() == [[4, 0, 2], [6, 7, 1], [9, 8, 2], [2, 3, 1]]
    assert contiguous_runs(src[:0], dst[:0]).shape == (0, 3)


@st.composite
def copy_cases(draw: st.DrawFn) -> tuple[KVLayout, int, int, bool, list[int], list[int], int, bool]:
    layout = draw(small_layouts)
    src_n = draw(st.integers(1, 24))
    same_pool = draw(st.booleans())
    dst_n = src_n if same_pool else draw(st.integers(1, 24))
    count = draw(st.integers(0, min(src_n, dst_n) // 2 if same_pool else min(src_n, dst_n)))
    perm = draw(st.permutations(range(dst_n)))
    dst_pages = list(perm[:count])
    if same_pool:  # disjoint from the destination pages, repeats allowed on the read side
        rest = [p for p in range(src_n) if p not in dst_pages]
        src_pages = draw(st.lists(st.sampled_from(rest), min_size=count, max_size=count)) if count else []
    else:
        src_pages = draw(st.lists(st.integers(0, src_n - 1), min_size=count, max_size=count))
    seed = draw(st.integers(0, 2**32 - 1))
    by_runs = draw(st.booleans())
    return layout, src_n, dst_n, same_pool, src_pages, dst_pages, seed, by_runs


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(copy_cases())
async def test_copy_is_bit_exact_and_touches_only_its_pages(
    case: tuple[KVLayout, int, int, bool, list[int], list[int], int, bool],
) -> None:
    layout, src_n, dst_n, same_pool, src_pages, dst_pages, seed, by_runs = case
    src = KVPool(layout, src_n, name="src")
    dst = src if same_pool else KVPool(layout, dst_n, name="dst")
    fill_random(src, seed)
    if not same_pool:
        fill_random(dst, seed + 1)
    src_before, dst_before = page_bytes_of(src), page_bytes_of(dst)
    # large_page_bytes=0 copies run by run; a huge one forces the gather/scatter path
    engine = CopyEngine(large_page_bytes=0 if by_runs else 1 << 62)

    await engine.copy(src, src_pages, dst, dst_pages)

    after = page_bytes_of(dst)
    expected = dst_before.copy()
    expected[dst_pages] = src_before[src_pages]
    assert np.array_equal(after, expected)
    if not same_pool:
        assert np.array_equal(page_bytes_of(src), src_before)
    assert engine.stats.pages == len(src_pages)
    assert engine.stats.bytes == len(src_pages) * layout.page_bytes
    assert engine.stats.staging_allocs == 0  # host copies move each page once, never via staging


async def test_zero_pages_return_at_once() -> None:
    pool = KVPool(KVLayout(1, 1, 8, 1, "float32"), 2)
    engine = CopyEngine()
    await engine.copy(pool, [], pool, [])
    assert engine.stats.batches == 0


async def test_copy_validation() -> None:
    a = KVPool(KVLayout(1, 1, 8, 1, "float32"), 4, name="a")
    b = KVPool(KVLayout(1, 1, 8, 1, "float64"), 4, name="b")
    c = KVPool(KVLayout(1, 1, 8, 1, "float32"), 4, name="c")
    engine = CopyEngine()
    with pytest.raises(ValueError, match="layouts differ"):
        await engine.copy(a, [0], b, [0])
    with pytest.raises(ValueError, match="2 src_pages but 1 dst_pages"):
        await engine.copy(a, [0, 1], c, [0])
    with pytest.raises(ValueError, match="share page 1"):
        await engine.copy(a, [0, 1], a, [1, 2])
    with pytest.raises(ValueError, match="dst_pages repeats page 3"):
        await engine.copy(a, [0, 1], c, [3, 3])
    with pytest.raises(IndexError, match=r"c: dst_pages\[0\] = 9"):
        await engine.copy(a, [0], c, [9])
    with pytest.raises(ValueError, match="threads"):
        CopyEngine(threads=0)
    assert engine.stats.batches == 0


async def test_host_copies_allocate_nothing_and_reserve_allocates_once() -> None:
    layout = KVLayout(1, 2, 8, 2, "float32")
    src, dst = KVPool(layout, 64), KVPool(layout, 64)
    engine = CopyEngine(large_page_bytes=1 << 62)
    for k in (32, 1, 7):
        await engine.copy(src, range(0, 2 * k, 2), dst, range(1, 2 * k, 2))
    assert engine.stats.staging_allocs == 0
    engine.reserve(64 * layout.page_bytes)  # staging for GPU copies, taken ahead of time
    assert engine.stats.staging_allocs == 1


async def test_copies_run_off_the_event_loop() -> None:
    """Each copy blocks its worker until the loop has ticked: if a copy ran on the loop thread the
    ticker could never tick and the copy would time out, failing the test."""
    layout = KVLayout(2, 2, 16, 4, "bfloat16")
    src, dst = KVPool(layout, 32), KVPool(layout, 32)
    fill_random(src, 7)
    engine = CopyEngine(threads=2)
    ticked = threading.Event()
    ticks = 0
    stalled: list[bool] = []
    plain = engine._copy_host

    def gated(*args: object) -> None:
        stalled.append(not ticked.wait(timeout=20))
        plain(*args)  # type: ignore[arg-type]

    engine._copy_host = gated  # type: ignore[method-assign]

    async def ticker(done: trio.Event) -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            if ticks >= 5:
                ticked.set()
            await trio.sleep(0)

    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker, done)
        async with trio.open_nursery() as copies:
            copies.start_soon(engine.copy, src, range(0, 16), dst, range(16, 32))
            copies.start_soon(engine.copy, src, range(16, 32), dst, range(0, 16))
        done.set()
    assert stalled == [False, False]
    assert ticks >= 5
    assert torch.equal(dst.words_view()[16:], src.words_view()[:16])
    assert torch.equal(dst.words_view()[:16], src.words_view()[16:])


async def test_loop_keeps_ticking_during_real_copies() -> None:
    layout = KVLayout(4, 8, 64, 16, "bfloat16")  # 1 MiB pages
    src, dst = KVPool(layout, 24), KVPool(layout, 24)
    fill_random(src, 3)
    engine = CopyEngine()
    ticks = 0
    running = True

    async def ticker() -> None:
        nonlocal ticks
        while running:
            ticks += 1
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        for rounds in range(4):
            before = ticks
            await engine.copy(src, range(rounds % 2, 24, 2), dst, range(24 - 1 - rounds % 2, -1, -2))
            assert ticks > before  # the ticker ran while this copy was in flight
        running = False
    # the last two rounds sent the even source pages to the odd destination pages, reversed, and
    # the odd ones to the even ones
    assert torch.equal(dst.words_view()[1::2].flip(0), src.words_view()[0::2])
    assert torch.equal(dst.words_view()[0::2].flip(0), src.words_view()[1::2])


# -------------------------------------------------------------------------------- StreamTracker


class FakeEvent:
    """A completion that a test finishes by hand. `seen` lists, in order, the events whose query
    answered finished; a query of any event other than the oldest one not yet seen finished (the
    head of the tracker's queue) is recorded in `misqueried`."""

    def __init__(self, index: int, finished: list[bool], seen: list[int], misqueried: list[int]) -> None:
        self.index, self.finished, self.seen, self.misqueried = index, finished, seen, misqueried

    def query(self) -> bool:
        if self.index != len(self.seen):
            self.misqueried.append(self.index)
        if self.finished[self.index]:
            self.seen.append(self.index)
            return True
        return False


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(1, 12), order=st.data())
def test_tracker_wakes_every_waiter_in_order(n: int, order: st.DataObject) -> None:
    pauses = order.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="pauses")
    cancel = order.draw(st.sets(st.integers(0, n - 1), max_size=n // 2), label="cancelled")
    tracker = StreamTracker(min_s=1e-3, max_s=8e-3)
    finished = [False] * n
    seen: list[int] = []
    misqueried: list[int] = []
    returned: list[int] = []

    async def waiter(i: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.move_on_after(0.002 if i in cancel else math.inf):
            task_status.started()
            # `wait` queues event i before its first checkpoint, so events are queued in the order
            # they are "recorded" (the order the fake device finishes them), as the tracker requires
            await tracker.wait(FakeEvent(i, finished, seen, misqueried))
            assert all(finished[: i + 1])  # woken only after its own (and every earlier) event
            returned.append(i)

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    # one at a time: trio runs tasks started together in an arbitrary order
                    await nursery.start(waiter, i)
                await trio.sleep(0.001)
                for i, pause in enumerate(pauses):  # the "device" completes events in order
                    await trio.sleep(pause * 0.003)
                    finished[i] = True

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert tracker.polls, "nothing was polled"
    assert misqueried == []  # only the oldest pending event is ever queried
    assert set(returned) >= {i for i in range(n) if i not in cancel}  # no waiter was left stranded
    # Each completion is taken off the queue exactly when a query sees it finished, so the events
    # seen finished are a prefix of the queue, each seen once, and the ones left queued are the
    # rest: they may only belong to cancelled waiters (nobody is left to poll them).
    assert seen == list(range(n - tracker.pending))
    assert all(i in cancel for i in range(n - tracker.pending, n))


async def test_tracker_reports_a_failed_completion_to_its_waiter() -> None:
    class Broken:
        def query(self) -> bool:
            raise RuntimeError("device fault")

    tracker = StreamTracker()
    with pytest.raises(RuntimeError, match="device fault"):
        await tracker.wait(Broken())
    assert tracker.pending == 0


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("by_runs", [False, True])
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
async def test_cuda_copies_are_bit_exact(direction: str, by_runs: bool) -> None:
    layout = KVLayout(2, 2, 64, 8, "bfloat16")
    host, dev = KVPool(layout, 64, name="l2"), KVPool(layout, 64, device="cuda", name="l1")
    assert host.pinned
    src, dst = {"h2d": (host, dev), "d2h": (dev, host), "d2d": (dev, dev)}[direction]
    src.words_view().copy_(torch.randint(-(2**62), 2**62, tuple(src.words_view().shape), dtype=torch.int64))
    before = page_bytes_of(dst)
    rng = np.random.default_rng(1)
    src_pages = rng.permutation(32)[:20] if direction == "d2d" else rng.permutation(64)[:20]
    dst_pages = (32 + rng.permutation(32)[:20]) if direction == "d2d" else rng.permutation(64)[:20]
    engine = CopyEngine(large_page_bytes=0 if by_runs else 1 << 62)
    await engine.copy(src, src_pages, dst, dst_pages)
    expected = before.copy()
    expected[dst_pages] = page_bytes_of(src)[src_pages]
    assert np.array_equal(page_bytes_of(dst), expected)
