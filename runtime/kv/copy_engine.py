"""Batched page copies between KV pools, off the trio event loop.

One `copy` moves a whole batch of pages (a `Backup`, `LoadBack` or a prefetch's staging) as a few
large operations, never a Python call per small page:

- Host to host: a memory-bound copy on a worker thread (torch kernels release the GIL), bounded by
  the engine's own `CapacityLimiter` so copies neither queue behind trio's shared default limiter
  nor oversubscribe the cores. Small pages go as one gather into a reused staging buffer
  (`index_select(out=)`) plus one scatter (`index_copy_`) through the int64 view of the pages:
  torch's CPU scatter runs element by element, so the widest element is several times faster
  than bytes. When each contiguous run of pages is at least `large_page_bytes` (256 KiB by
  default), one `copy_` per run is faster: a run is a single memcpy, the ~10 us per call is
  amortised, and the staging pass is saved (measured 6.8-9 GB/s against 3.5 GB/s for the two-pass
  gather/scatter at 256 KiB-4 MiB pages, while at 16 KiB the per-call cost drops the loop to
  1.4 GB/s).
- Either side on a GPU: the copies are issued on a side CUDA stream (per device, a `Lane`,
  `copy_lanes.py`) after it waits for the caller's current stream, an event is recorded, and the
  trio task waits for the event by polling `event.query()`; see `StreamTracker`. A step that
  reads a restored page runs once its copy's event has fired, never after a device-wide
  synchronize. The same structure runs on host memory with an `ImmediateLane` (its "stream" runs
  each operation as it is issued), which is how the tests exercise it without a GPU. Host memory
  should be pinned so the DMA runs asynchronously (a node's L2 is, when its L1 is on a GPU; a
  `KVPool` on a CUDA machine pins by default). The same 256 KiB threshold
  holds there: on an H200 (PCIe, 55 GB/s pinned), 1024 random 128 KiB pages moved at 20 GB/s by
  host gather + one DMA + device scatter against 12 GB/s page by page, and 256 KiB pages at
  5-19 GB/s against 23 GB/s (one DMA per page reaches 45-53 GB/s from 1 MiB up).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Protocol

import attrs
import numba
import numpy as np
import torch
import trio

from hicache.runtime.kv.copy_lanes import CudaLane, Lane
from hicache.runtime.kv.kv_pool import KVPool, PageIndices

LARGE_PAGE_BYTES = 1024 * 1024
"""Contiguous runs at least this long are copied one `copyto` per run; shorter ones go through the
single-pass row kernel (faster below about 1 MiB here: 6.8 vs 5.7 GB/s at 256 KiB pages)."""


class _Completion(Protocol):
    def query(self) -> bool: ...


@attrs.define
class _Waiter:
    event: _Completion
    done: bool = False
    abandoned: bool = False
    error: BaseException | None = None
    wake: trio.Event = attrs.Factory(trio.Event)


class StreamTracker:
    """Waits for completions recorded on one stream, which finish in the order they were recorded.

    Only the oldest pending completion is queried; everything that finished is woken in one pass.
    There is never more than one poller per stream and no thread per wait: the first waiter to
    find no poller becomes it, polls with a backoff from `min_s` to `max_s` until its own
    completion is done, then hands the role to the waiter at the head of the queue. (Blocking
    `synchronize()` calls on threads would need one thread per wait or a thread per stream, and
    `query()` is a non-blocking microsecond call.)
    """

    def __init__(self, *, min_s: float = 20e-6, max_s: float = 1e-3) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"StreamTracker: expected 0 < min_s <= max_s, got {min_s=} {max_s=}")
        self.min_s = min_s
        self.max_s = max_s
        self._fifo: collections.deque[_Waiter] = collections.deque()
        self._poller: _Waiter | None = None
        self.polls = 0

    @property
    def pending(self) -> int:
        return len(self._fifo)

    async def wait(self, event: _Completion) -> None:
        """Return once `event` (recorded after everything already queued here) has completed."""
        me = _Waiter(event)
        self._fifo.append(me)
        try:
            while not me.done:
                if self._poller is None:
                    self._poller = me
                    await self._poll_until(me)
                else:
                    await me.wake.wait()
                    me.wake = trio.Event()
        finally:
            # A cancelled waiter leaves its completion queued (it is drained in order); whoever
            # leaves the poller's role, or was handed it but cancelled, hands it on.
            me.abandoned = not me.done
            if self._poller is me:
                self._poller = None
            if self._poller is None:
                self._promote()
        if me.error is not None:
            raise me.error

    def _promote(self) -> None:
        """Wake the oldest waiter still waiting, to take over polling."""
        for waiter in self._fifo:
            if not waiter.abandoned:
                waiter.wake.set()
                return

    async def _poll_until(self, me: _Waiter) -> None:
        delay = self.min_s
        while True:
            progressed = False
            while self._fifo:
                head = self._fifo[0]
                self.polls += 1
                try:
                    finished = head.event.query()
                except Exception as exc:  # e.g. a CUDA error: report it to the waiter it belongs to
                    head.error, finished = exc, True
                if not finished:
                    break
                self._fifo.popleft()
                head.done = True
                head.wake.set()
                progressed = True
            if me.done:
                return
            delay = self.min_s if progressed else min(delay * 2, self.max_s)
            await trio.sleep(delay)


@attrs.define
class CopyStats:
    batches: int = 0
    pages: int = 0
    bytes: int = 0
    staging_allocs: int = 0
    """Staging buffers allocated: grows only when a batch is larger than any before it."""


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """`(k, 3)` rows `(src_start, dst_start, length)` covering the pairs in order, merging pairs
    where both sides continue the previous page."""
    if src.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return np.stack((src[starts], dst[starts], lengths), axis=1)


@numba.njit(nogil=True, cache=True)
def _copy_rows(
    src: np.ndarray, s_idx: np.ndarray, dst: np.ndarray, d_idx: np.ndarray
) -> None:  # pragma: no cover
    """dst[d_idx[i]] = src[s_idx[i]] for every i, one pass over each page (GIL released)."""
    words = src.shape[1]
    for i in range(s_idx.shape[0]):
        s, d = s_idx[i], d_idx[i]
        for w in range(words):
            dst[d, w] = src[s, w]


class CopyEngine:
    """Executes page copies between pools; one engine per node (it owns staging buffers, CUDA side
    streams and a thread limiter of `threads` tokens: 1-2 saturate host memory bandwidth).

    A cancelled `copy` returns only once the copy already under way has finished, so the caller
    may reuse the pages as soon as it regains control.

    `on_lane(pool)` says which pools are device memory, whose copies go through a lane
    (`lanes(device)` makes one per device, once); by default the pools on a GPU, each GPU's lane
    a CUDA side stream. Tests name host pools instead and give `ImmediateLane`s, or lanes whose
    events fire when the test says so.
    """

    def __init__(
        self,
        *,
        threads: int = 1,
        large_page_bytes: int = LARGE_PAGE_BYTES,
        poll_min_s: float = 20e-6,
        poll_max_s: float = 1e-3,
        on_lane: Callable[[KVPool], bool] | None = None,
        lanes: Callable[[torch.device], Lane] = CudaLane,
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"CopyEngine.threads: expected an int >= 1, got {threads!r}")
        if large_page_bytes < 0:
            raise ValueError(f"CopyEngine.large_page_bytes: expected >= 0, got {large_page_bytes!r}")
        self.threads = threads
        self.large_page_bytes = large_page_bytes
        self.stats = CopyStats()
        self._limiter = trio.CapacityLimiter(threads)
        self._lock = threading.Lock()
        self._poll = (poll_min_s, poll_max_s)
        # Free staging buffers (flat int64), per (device, pinned). At most `threads` are taken at
        # once on the host; a GPU copy holds its buffers until the GPU is done with them.
        self._staging: dict[tuple[str, bool], list[torch.Tensor]] = collections.defaultdict(list)
        # Compile (or load) the row-copy kernel now: a first call inside a worker thread would
        # hold the GIL while numba compiles, stalling the event loop.
        _copy_rows(
            np.zeros((1, 1), np.int64),
            np.zeros(0, np.int64),
            np.zeros((1, 1), np.int64),
            np.zeros(0, np.int64),
        )
        self._on_lane = on_lane if on_lane is not None else _is_cuda
        self._make_lane = lanes
        self._lanes: dict[torch.device, tuple[Lane, StreamTracker]] = {}

    # ---------------------------------------------------------------------------------- public

    async def copy(
        self,
        src: KVPool,
        src_pages: PageIndices,
        dst: KVPool,
        dst_pages: PageIndices,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Copy `src` page `src_pages[i]` to `dst` page `dst_pages[i]` for every i, bit-exactly.

        With `nursery.start(engine.copy, ...)` the call returns once the copy has been issued
        (on a GPU: enqueued on the side stream), which lets a caller enqueue other GPU work that
        should overlap it; the call itself returns once the copy has completed.
        """
        s_idx, d_idx = self._check(src, src_pages, dst, dst_pages)
        n = s_idx.size
        if n == 0:
            task_status.started()
            return
        self.stats.batches += 1
        self.stats.pages += n
        self.stats.bytes += n * src.layout.page_bytes
        if self._on_lane(src) or self._on_lane(dst):
            await self._copy_on_lane(src, s_idx, dst, d_idx, task_status)
        else:
            task_status.started()
            await trio.to_thread.run_sync(
                self._copy_host, src, s_idx, dst, d_idx, limiter=self._limiter, thread_name="kv-copy"
            )

    def reserve(self, nbytes: int, *, device: str | torch.device = "cpu") -> None:
        """Allocate and touch staging room for batches of up to `nbytes` now, so the first copies
        pay no page faults. Host staging is pinned when CUDA is available."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        pinned = dev.type == "cpu" and torch.cuda.is_available()
        count = self.threads if dev.type == "cpu" else 1
        taken = [self._take(dev, pinned, -(-nbytes // 8)) for _ in range(count)]
        for buf in taken:
            buf.zero_()
            self._give(dev, pinned, buf)

    # ------------------------------------------------------------------------------ validation

    def _check(
        self, src: KVPool, src_pages: PageIndices, dst: KVPool, dst_pages: PageIndices
    ) -> tuple[np.ndarray, np.ndarray]:
        if src.layout != dst.layout:
            raise ValueError(f"copy {src.name} -> {dst.name}: layouts differ ({src.layout} vs {dst.layout})")
        s_idx = src.indices(src_pages, what="src_pages")
        d_idx = dst.indices(dst_pages, what="dst_pages", distinct=True)
        if s_idx.size != d_idx.size:
            raise ValueError(
                f"copy {src.name} -> {dst.name}: {s_idx.size} src_pages but {d_idx.size} dst_pages"
            )
        if src is dst and np.intersect1d(s_idx, d_idx).size:
            raise ValueError(
                f"copy within {src.name}: src_pages and dst_pages share page "
                f"{np.intersect1d(s_idx, d_idx)[0]}"
            )
        if src.is_cuda and dst.is_cuda and src.device != dst.device:
            raise ValueError(
                f"copy {src.name} -> {dst.name}: pools on different GPUs ({src.device}, {dst.device})"
            )
        return s_idx, d_idx

    def _by_runs(self, runs: np.ndarray, n: int, page_bytes: int) -> bool:
        """Copy run by run when each contiguous run is long enough to amortise a call."""
        return n * page_bytes >= self.large_page_bytes * len(runs)

    # ----------------------------------------------------------------------------------- staging

    def _take(self, device: torch.device, pinned: bool, words: int) -> torch.Tensor:
        free = self._staging[(str(device), pinned)]
        buf = free.pop() if free else None
        if buf is None or buf.numel() < words:
            buf = torch.empty(words, dtype=torch.int64, device=device, pin_memory=pinned)
            with self._lock:
                self.stats.staging_allocs += 1
        return buf

    def _give(self, device: torch.device, pinned: bool, buf: torch.Tensor) -> None:
        self._staging[(str(device), pinned)].append(buf)

    # --------------------------------------------------------------------------------- host path

    def _copy_host(self, src: KVPool, s_idx: np.ndarray, dst: KVPool, d_idx: np.ndarray) -> None:
        # numpy views of the pools: numpy's copy is plain memcpy (torch's CPU copy_ is slower
        # here), and the numba kernel moves each page once with no staging buffer.
        src_w, dst_w = src.words_view().numpy(), dst.words_view().numpy()
        runs = contiguous_runs(s_idx, d_idx)
        if self._by_runs(runs, s_idx.size, src.layout.page_bytes):
            for s0, d0, k in runs.tolist():
                np.copyto(dst_w[d0 : d0 + k], src_w[s0 : s0 + k])
            return
        _copy_rows(src_w, s_idx.astype(np.int64, copy=False), dst_w, d_idx.astype(np.int64, copy=False))

    # ------------------------------------------------------------------------- device (lane) path

    def _lane(self, device: torch.device) -> tuple[Lane, StreamTracker]:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._lanes:
            tracker = StreamTracker(min_s=self._poll[0], max_s=self._poll[1])
            self._lanes[device] = (self._make_lane(device), tracker)
        return self._lanes[device]

    async def _copy_on_lane(
        self,
        src: KVPool,
        s_idx: np.ndarray,
        dst: KVPool,
        d_idx: np.ndarray,
        task_status: trio.TaskStatus[None],
    ) -> None:
        lane, tracker = self._lane(dst.device if self._on_lane(dst) else src.device)
        caller = lane.caller()
        held: list[tuple[torch.device, bool, torch.Tensor]] = []
        event, finish = await trio.to_thread.run_sync(
            self._issue, src, s_idx, dst, d_idx, lane, caller, held, limiter=self._limiter
        )
        task_status.started()
        # The device owns the pages and the staging buffers until the event fires: a
        # cancellation waits for it rather than hand back memory that is still being written.
        with trio.CancelScope(shield=True):
            try:
                await tracker.wait(event)
                if finish is not None:
                    await trio.to_thread.run_sync(finish, limiter=self._limiter)
            finally:
                for dev, pinned, buf in held:
                    self._give(dev, pinned, buf)

    def _issue(
        self,
        src: KVPool,
        s_idx: np.ndarray,
        dst: KVPool,
        d_idx: np.ndarray,
        lane: Lane,
        caller: object,
        held: list[tuple[torch.device, bool, torch.Tensor]],
    ) -> tuple[object, Callable[[], None] | None]:
        """Enqueue the copy on `lane` (runs on a worker thread: issuing a thousand page copies
        or gathering host pages takes milliseconds). Returns the completion event and, for a
        device-to-host gather, the host scatter to run once the event has fired."""
        src_w, dst_w = src.words_view(), dst.words_view()
        n, words = s_idx.size, src.layout.page_words
        device, cpu = lane.device, torch.device("cpu")
        src_dev, dst_dev = self._on_lane(src), self._on_lane(dst)
        finish: Callable[[], None] | None = None

        def staging(dev: torch.device, pinned: bool) -> torch.Tensor:
            buf = self._take(dev, pinned, n * words)
            held.append((dev, pinned, buf))
            return buf[: n * words].view(n, words)

        def on(on_device: bool, idx: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(idx)
            return t.to(device, non_blocking=True) if on_device else t

        with lane.issuing(caller):
            runs = contiguous_runs(s_idx, d_idx)
            if self._by_runs(runs, n, src.layout.page_bytes):
                for s0, d0, k in runs.tolist():
                    dst_w[d0 : d0 + k].copy_(src_w[s0 : s0 + k], non_blocking=True)
            elif src_dev and dst_dev:
                dev_stg = staging(device, False)
                torch.index_select(src_w, 0, on(True, s_idx), out=dev_stg)
                dst_w.index_copy_(0, on(True, d_idx), dev_stg)
            elif dst_dev:  # host -> device: gather on the host, one DMA, scatter on the device
                host_stg = staging(cpu, lane.pinned)
                torch.index_select(src_w, 0, torch.from_numpy(s_idx), out=host_stg)
                dev_stg = staging(device, False)
                dev_stg.copy_(host_stg, non_blocking=True)
                dst_w.index_copy_(0, on(True, d_idx), dev_stg)
            else:  # device -> host: gather on the device, one DMA, scatter on the host afterwards
                dev_stg = staging(device, False)
                torch.index_select(src_w, 0, on(True, s_idx), out=dev_stg)
                host_stg = staging(cpu, lane.pinned)
                host_stg.copy_(dev_stg, non_blocking=True)
                d_cpu = torch.from_numpy(d_idx)

                def finish() -> None:
                    dst_w.index_copy_(0, d_cpu, host_stg)

            event = lane.record()
        return event, finish


def _is_cuda(pool: KVPool) -> bool:
    return pool.is_cuda
