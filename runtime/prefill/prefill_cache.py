"""The prefill node's own KV cache: the core's tiered radix tree over pages it computed or read.

What is cached, read from L3, computed and inserted is decided by the core's prefill planner
(`hicache.core.prefill_plan`), as in the simulator's prefill node; this cache carries the
decisions out on real pages (copies between L1, L2 and L3, and the model's forward).

A prompt is cut into pages with the decode nodes' salted chained keys (`hicache.core.pages`:
the `kv` message's `namespace` is the seed), so the pages a prefill node finds are exactly those
of the same model and tenant: another tenant's identical prompt has other keys, and misses.

For each prompt, one at a time (the compute is one stream anyway):
1. the tree gives the prefix held on L1 (locked) and on L2 (pinned, copied back into L1);
2. with a store, `exists` says how many following pages L3 holds; they are read into L1 when
   that beats computing them (`restore_pays`, the simulator's prefill rule), counting the read
   and compute speeds (settings, refined by a running estimate of what the node measures);
   a failed or short read leaves the rest to compute;
3. the rest is computed into L1 pages with the model's paged prefix path (`prefill_into`):
   the last prompt token always, since it yields the first output token. When every page is
   cached, that token is computed on a scratch copy of its page: a tree page is never written;
4. the full pages enter the tree (which adopts new slots and frees duplicates), its Backup
   commands (L1 -> L2, write-through) are executed at once, and L1 room comes from the tree's
   eviction policy.

What is sent to a decode node is a copy of the pages taken before the tree can evict them.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
import trio

from hicache.core.commands import Backup
from hicache.core.pages import page_keys
from hicache.core.prefill_plan import PrefillPlan, PrefillPlanner, attribute
from hicache.core.restore_cost import RestorePath
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.model.llama import LlamaModel, to_pages
from hicache.runtime.storage.base import StorageBackend

log = logging.getLogger("hicache.runtime.prefill")

DEFAULT_CACHE_BYTES = 512 << 20  # L1 of the prefill cache: as much KV as the old prompt memo kept
DEFAULT_READ_BPS = 1e9  # L3 read speed, bytes/s, until the node has measured its own reads
DEFAULT_COMPUTE_TPS = 2e3  # prompt tokens/s, until the node has measured its own forwards
SMOOTHING = 0.25  # weight of the newest measurement in a running estimate
MEASURED_MIN_TOKENS = 64  # shorter forwards do not move the compute estimate
# L1 pages a prompt computes in beyond its full pages: its partial last page or, when it has
# none, a scratch page on which its last token is computed (a tree page is never written).
WORK_PAGES = 1


@attrs.define
class Speeds:
    """The read and compute speeds the cost rule weighs; `measure` refines them as they happen
    (an exponential moving average, so one slow read or cold forward does not decide alone)."""

    read_bps: float = DEFAULT_READ_BPS
    compute_tps: float = DEFAULT_COMPUTE_TPS
    read_latency_s: float = 0.0
    measure: bool = True

    def __attrs_post_init__(self) -> None:
        for name in ("read_bps", "compute_tps"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"Speeds.{name}: expected a finite number > 0, got {value!r}")
        if not self.read_latency_s >= 0:
            raise ValueError(f"Speeds.read_latency_s: expected >= 0, got {self.read_latency_s!r}")

    def read_seconds(self, nbytes: int) -> float:
        return RestorePath(latency=self.read_latency_s, bandwidth=self.read_bps).seconds(nbytes)

    def compute_seconds(self, tokens: int) -> float:
        return tokens / self.compute_tps

    def saw_read(self, nbytes: int, seconds: float) -> None:
        if self.measure and nbytes > 0 and seconds > 0:
            self.read_bps += SMOOTHING * (nbytes / seconds - self.read_bps)

    def saw_compute(self, tokens: int, seconds: float) -> None:
        # A forward of a few tokens measures its fixed overhead, not the rate of a long prefix.
        if self.measure and tokens >= MEASURED_MIN_TOKENS and seconds > 0:
            self.compute_tps += SMOOTHING * (tokens / seconds - self.compute_tps)


@attrs.frozen
class Prefilled:
    """A prompt's pages [first, last) (a copy), its last logits, and where its tokens came from.

    `l1`, `l2`, `l3` count prompt tokens not computed here (at most all but the last one)."""

    pages: torch.Tensor
    logits: torch.Tensor
    l1: int = 0
    l2: int = 0
    l3: int = 0

    @property
    def cached(self) -> int:
        return self.l1 + self.l2 + self.l3


@attrs.define
class CacheStats:
    """Tokens, per source, of the prompts served; pages read from L3 and reads that fell short."""

    computed: int = 0
    l1: int = 0
    l2: int = 0
    l3: int = 0
    l3_declined_pages: int = 0  # held by L3, computed instead: the read would have been slower
    l3_short_reads: int = 0  # reads that returned fewer pages than `exists` promised (or failed)
    uncached: int = 0  # prompts computed without the cache: too large for L1, or no room in it


@attrs.define(eq=False)
class CachedWork:
    """An open prompt of the cache: its plan (the L1 pages it holds), the page table it computes
    in (`run`: a scratch page in place of a cached last page) and the one its pages are sent
    from (`table`), and how far it is computed (`done`, from `start`)."""

    plan: PrefillPlan
    ids: np.ndarray
    table: list[int]
    run: list[int]
    start: int
    l1: int
    l2: int
    l3: int
    done: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.done = self.start

    def sent_pages(self, first: int, last: int) -> torch.Tensor:
        return torch.tensor(self.table[first:last], dtype=torch.int64)

    def tail(self, last: int) -> int:
        """Tokens of the prompt on page `last - 1` when it is the prompt's partial last page, else 0."""
        page = self.plan.page_size
        n = len(self.ids)
        return n % page if last == -(-n // page) else 0


class PrefillCache:
    """L1 (and optionally L2) pages of KV this node computed or read, under the core's tree."""

    def __init__(
        self,
        model: LlamaModel,
        layout: KVLayout,
        l1_pages: int,
        *,
        l2_pages: int = 0,
        store: StorageBackend | None = None,
        speeds: Speeds | None = None,
        eviction: str = "lru",
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        """`limiter` bounds the threads the model runs in (the node shares it with its other
        compute)."""
        self.model = model
        self.layout = layout
        # L1 is where the model computes (its pages are the forward's K/V); L2 and the pages
        # read from L3 stay in host memory.
        self.l1 = KVPool(layout, l1_pages, device=model.device, name="prefill-L1", lazy=True)
        pinned = self.l1.is_cuda  # pinned only where it makes L1 <-> L2 copies asynchronous DMA
        self.l2 = (
            KVPool(layout, l2_pages, pinned=pinned, name="prefill-L2", lazy=True) if l2_pages > 0 else None
        )
        self.planner = PrefillPlanner(
            "prefill", l1_pages, l2_pages, layout.page_size, eviction=eviction, copy_backup=self._copy_backup
        )
        self.tree = self.planner.tree
        self.store = store
        self.speeds = speeds if speeds is not None else Speeds()
        self.stats = CacheStats()
        self._limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
        self._lock = trio.Lock()  # one prompt at a time holds the tree
        self._owners = itertools.count(1)

    async def prefill(
        self,
        tokens: Sequence[int],
        namespace: int,
        first_page: int,
        last_page: int,
        stream: LayerGroups | None = None,
    ) -> Prefilled:
        """The prompt's pages [first_page, last_page) and last logits, reusing what is cached,
        computed in one forward. With `stream`, each layer group of those pages is handed to it
        (from the compute thread) as soon as prefill has stored it; a prompt computed without
        the cache is not streamed (`stream.sent` stays 0). (The prefill node computes in
        chunks instead: `open`, then `forward` per chunk, then `close`.)"""
        ids = np.asarray(tokens, dtype=np.int64)
        work = await self.open(ids, namespace)
        if work is None:
            return await self.compute_uncached(ids, first_page, last_page)
        try:
            on_layer = None
            if stream is not None and last_page > first_page:
                on_layer = stream.hook(
                    self.l1.data, work.sent_pages(first_page, last_page), work.tail(last_page)
                )
            logits = await self.forward(work, work.start, len(ids), on_layer)
            return self.close(work, logits, first_page, last_page)
        finally:
            self.drop(work)

    async def compute_uncached(self, ids: np.ndarray, first: int, last: int) -> Prefilled:
        """A prompt computed from scratch, outside the cache (too large for L1, or no room)."""
        self.stats.uncached += 1
        self.stats.computed += len(ids)
        return await compute_all(
            self.model, ids, self.layout.page_size, first, last, self._limiter, self.speeds
        )

    async def open(self, ids: np.ndarray, namespace: int) -> CachedWork | None:
        """Match the prompt, restore its cached prefix into L1 and reserve L1 pages for the
        rest: the prompt then computes positions [`start`, len) in any number of `forward`s
        and ends with `close` (its pages enter the tree) or `drop`. None: too large for L1, or
        L1 is held by nothing this node may evict."""
        if not self.planner.fits(len(ids), WORK_PAGES):
            return None
        keys = page_keys(ids, self.layout.page_size, namespace).tolist()
        async with self._lock:  # match, reserve and restore as one: one prompt at a time
            return await self._open(ids, keys)

    async def _open(self, ids: np.ndarray, keys: list[int]) -> CachedWork | None:
        planner, page, n = self.planner, self.layout.page_size, len(ids)
        total = -(-n // page)
        plan = planner.match(keys, n, ("prefill", next(self._owners)), time.monotonic())
        d, h = plan.device_pages, plan.host_pages
        try:
            l3 = await self._l3_pages(plan)
            if planner.reserve(plan, WORK_PAGES) is None:
                planner.finish(plan, time.monotonic(), insert=False)
                return None
            table = plan.table()[:total]  # the last reserved slot is past it: the scratch page
            if h:  # L2 -> L1: the tree takes these slots back on insert
                assert self.l2 is not None
                src = torch.tensor(plan.host_slots, dtype=torch.int64)
                pages = self.l2.data[src].to(self.l1.device)
                self.l1.data[torch.tensor(table[d : d + h], dtype=torch.int64)] = pages
            read = await self._read_l3(keys[d + h : d + h + l3], table[d + h : d + h + l3]) if l3 else 0
        except BaseException:
            planner.finish(plan, time.monotonic(), insert=False)
            raise
        planner.restored(plan)  # its pages are back on L1: L2 may make room again
        cached = d + h + read  # leading pages whose KV is here
        start = plan.cached_tokens(cached)
        run = list(table)
        if cached * page > start:
            # The last token is computed on a scratch copy of its page: tree pages stay as
            # they were computed (and as the decode nodes that hold them got them).
            scratch = plan.table()[-1]
            self.l1.data[scratch] = self.l1.data[table[cached - 1]]
            run[cached - 1] = scratch
        l1, l2, l3_tokens = attribute(start, d * page, h * page, read * page)
        return CachedWork(plan, ids, table, run, start, l1, l2, l3_tokens)

    async def forward(
        self, work: CachedWork, lo: int, hi: int, on_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Compute positions [lo, hi) of an open prompt into its L1 pages; the last one's logits."""
        return await trio.to_thread.run_sync(self.forward_sync, work, lo, hi, on_layer, limiter=self._limiter)

    def forward_sync(
        self, work: CachedWork, lo: int, hi: int, on_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """`forward` on the calling thread (the prefill node's step runs its chunks in one)."""
        began = time.perf_counter()
        logits = self.model.prefill_into(self.l1.data, work.run, lo, work.ids[lo:hi].tolist(), on_layer)
        self.speeds.saw_compute(hi - lo, time.perf_counter() - began)
        work.done = hi
        return logits

    def pages(self, work: CachedWork, first: int, last: int) -> torch.Tensor:
        """A copy of the prompt's pages [first, last), zero past the prompt on its last page."""
        pages = self.l1.data[work.sent_pages(first, last)]  # a copy
        tail = work.tail(last)
        if tail and last > first:
            # Past the prompt, a reused slot holds whatever it held (another prompt's KV,
            # maybe another tenant's): what is sent is zero there, as computing gives.
            pages[-1, :, :, tail:] = 0
        return pages

    def close(self, work: CachedWork, logits: torch.Tensor, first: int, last: int) -> Prefilled:
        """A fully computed prompt: its pages [first, last) (a copy, taken before the tree may
        evict them), then its pages enter the tree."""
        pages = self.pages(work, first, last)
        n = len(work.ids)
        self.stats.computed += n - work.start
        self.stats.l1 += work.l1
        self.stats.l2 += work.l2
        self.stats.l3 += work.l3
        self.planner.finish(work.plan, time.monotonic())
        return Prefilled(pages, logits, work.l1, work.l2, work.l3)

    def drop(self, work: CachedWork) -> None:
        """Let a prompt go that did not `close` (cancelled or failed): the full pages it did
        compute still enter the tree, so a retry of it resumes from there; the rest is freed.
        Nothing may compute into its pages any more. Calling it after `close` does nothing."""
        if work.plan.done:
            return
        computed = max(work.done // self.layout.page_size, work.plan.device_pages)
        self.planner.finish(work.plan, time.monotonic(), insert=computed > 0, pages=computed)

    def _copy_backup(self, c: Backup) -> bool:
        """A write-through backup, L1 -> L2, done now (a copy within host memory)."""
        if self.l2 is None or not c.device_slots:
            return False
        dst = torch.tensor(c.host_slots, dtype=torch.int64)
        self.l2.data[dst] = self.l1.data[torch.tensor(c.device_slots, dtype=torch.int64)].cpu()
        return True

    async def _l3_pages(self, plan: PrefillPlan) -> int:
        """Pages after the tree's prefix worth reading from L3: held there, and faster read than
        computed (the planner weighs the two)."""
        start = plan.device_pages + plan.host_pages
        if self.store is None or start >= len(plan.keys):
            return 0
        try:
            held = await self.store.exists(list(plan.keys[start:]))
        except Exception as exc:  # a store fault is a miss, never a failed request
            log.warning("L3 exists() failed, computing instead: %s: %s", type(exc).__name__, exc)
            return 0
        l3 = self.planner.take_l3(
            plan,
            int(held),
            lambda pages: self.speeds.read_seconds(pages * self.layout.page_bytes),
            lambda pages: self.speeds.compute_seconds(pages * self.layout.page_size),
        )
        self.stats.l3_declined_pages += plan.l3_declined
        return l3

    async def _read_l3(self, keys: list[int], slots: list[int]) -> int:
        """Read `keys` into L1 `slots`; how many leading pages arrived intact (0 on an error)."""
        assert self.store is not None
        began = time.perf_counter()
        try:
            if not self.l1.is_cuda:
                got = await self.store.get(keys, self.l1, slots)
            else:  # a store reads into host memory: through a bounce pool, then to the device
                bounce = KVPool(self.layout, len(keys), name="prefill-L3-read")
                got = await self.store.get(keys, bounce, list(range(len(keys))))
                at = torch.tensor(slots[:got], dtype=torch.int64)
                self.l1.data[at] = bounce.data[:got].to(self.l1.device)
        except Exception as exc:  # a store fault is a miss, never a failed request
            log.warning("L3 read failed, computing instead: %s: %s", type(exc).__name__, exc)
            got = 0
        got = max(0, min(int(got), len(keys)))
        if got < len(keys):
            self.stats.l3_short_reads += 1
        self.speeds.saw_read(got * self.layout.page_bytes, time.perf_counter() - began)
        return got

    def check(self) -> None:
        """The tree's invariants, and that no slot is left to a finished prompt."""
        self.tree.check()
        for pool in (self.tree.device_pool, self.tree.host_pool):
            stray = [s for s in range(pool.capacity) if pool.owner_of(s) not in (None, "tree")]
            if stray:
                raise AssertionError(f"{pool.name}: slots {stray[:8]} still owned by a finished prompt")


async def compute_all(
    model: LlamaModel,
    ids: np.ndarray,
    page_size: int,
    first: int,
    last: int,
    limiter: trio.CapacityLimiter,
    speeds: Speeds | None = None,
) -> Prefilled:
    """The prompt computed from scratch, with nothing cached: pages [first, last) and logits."""
    began = time.perf_counter()
    kv, logits = await trio.to_thread.run_sync(model.forward, torch.from_numpy(ids.copy()), limiter=limiter)
    if speeds is not None:
        speeds.saw_compute(len(ids), time.perf_counter() - began)
    return Prefilled(to_pages(kv, page_size)[first:last], logits)


class LayerGroups:
    """Where a prompt's pages go, layer group by layer group, while prefill computes them.

    `hook` gives the model an `on_layer` that, at the end of each of `groups` layer groups,
    copies those layers of the pages being sent (zero past the prompt on its last page) and
    hands them to `deliver(lo, hi, part)` — on the compute thread, so `deliver` must only copy
    and hand over (e.g. `trio.from_thread`). `sent` counts the groups delivered."""

    def __init__(self, layers: int, groups: int, deliver: Callable[[int, int, torch.Tensor], None]) -> None:
        if groups < 1:
            raise ValueError(f"groups: expected >= 1, got {groups}")
        groups = min(groups, layers)
        self.ends = sorted({round((g + 1) * layers / groups) for g in range(groups)})
        self.deliver = deliver
        self.sent = 0

    def hook(self, pool: torch.Tensor, pages: torch.Tensor, tail: int) -> Callable[[int], None]:
        lo = 0

        def on_layer(index: int) -> None:
            nonlocal lo
            if index + 1 not in self.ends:
                return
            part = pool[pages, lo : index + 1]  # a copy: the pages' layers [lo, index]
            if tail:
                part[-1, :, :, tail:] = 0
            self.deliver(lo, index + 1, part)
            self.sent += 1
            lo = index + 1

        return on_layer
