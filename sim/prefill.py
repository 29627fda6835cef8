"""A prefill node: a FIFO of prompts, its own tiered cache, and the compute they cost.

Like a real HiCache deployment, a prefill node keeps the core's tiered tree (L1 on its GPUs,
L2 in host memory) and reads the shared L3, so it computes only the part of a prompt that none
of them holds. What is cached, read, computed and inserted is decided by the core's prefill
planner (`hicache.core.prefill_plan`), as in the runtime's prefill node; this node turns those
pages into time. Restoring that prefix costs time too: L2 pages cross the host link, L3 pages
come through the shared storage channel and then the host link — only when that is faster than
computing them again, counting the storage channel's backlog. A switch turns the cache off
(every prompt computed from scratch).

Simplifications, stated: a node runs one prompt at a time at its full compute rate (chunked
prefill batching changes latency, not throughput, of a compute-bound phase), and its restore
holds the node; what it computed enters its tree at once with write-through backups completed
immediately (its own L2 traffic is not modelled); it writes nothing to L3.

A job tells when its KV exists, for transfers that stream it: the part it restored from its
tree or L3 once the restore is done (`compute_start`), the computed part evenly over the
compute (`compute_start` to `compute_end`, layer by layer). Prefill is not chunked here, so a
prompt's layer g exists for all of its tokens at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import attrs

from hicache.core.prefill_plan import PrefillPlan, PrefillPlanner
from hicache.core.restore_cost import RestorePath
from hicache.core.tree import TieredRadixTree
from hicache.sim.channel import Channel
from hicache.sim.costs import NodeCosts
from hicache.sim.engine import EventLoop
from hicache.sim.store import SharedStore


@attrs.define(slots=True, eq=False)
class PrefillJob:
    rid: str
    prompt_len: int
    keys: Sequence[int]  # the prompt's full-page keys
    arrival: float
    started: float = -1.0
    compute_start: float = -1.0  # its restore done, compute begins (known once it starts)
    compute_end: float = -1.0  # when compute will end (known once it starts)
    done_at: float = -1.0
    cached_tokens: int = 0  # of the prompt, not computed here
    scale: float = 1.0  # its compute takes this many times the cost model's (`WorkItem.service_scale`)
    waiting: list[Callable[[], None]] = attrs.Factory(list)
    starting: list[Callable[[PrefillJob], None]] = attrs.Factory(list)


class PrefillNode:
    def __init__(
        self,
        index: int,
        loop: EventLoop,
        costs: NodeCosts,
        *,
        page_size: int,
        host: Channel,
        store: SharedStore | None,
        cache_pages: tuple[int, int] | None,  # (L1, L2) pages, or None for no prefill cache
    ) -> None:
        self.index = index
        self.loop = loop
        self.costs = costs
        self.page = page_size
        self.kvb = costs.model.kv_bytes_per_token
        self.host = host
        self.store = store
        self.planner: PrefillPlanner | None = None
        self.tree: TieredRadixTree | None = None
        if cache_pages is not None:
            l1, l2 = cache_pages
            self.planner = PrefillPlanner(f"P{index}", l1, l2, page_size)  # backups complete at once
            self.tree = self.planner.tree
        self.queue: deque[PrefillJob] = deque()
        self.jobs: dict[str, PrefillJob] = {}
        self.busy = False
        self.computed_tokens = 0
        self.cached_tokens = 0

    @property
    def load(self) -> int:
        return len(self.queue) + int(self.busy)

    def peek(self, keys: Sequence[int]) -> int:
        """Pages of `keys` this node could restore (its tree, then L3): for the router."""
        if self.tree is None:
            return 0
        return self.tree.peek(keys)

    def submit(self, job: PrefillJob) -> None:
        self.jobs[job.rid] = job
        self.queue.append(job)
        if not self.busy:
            self._next()

    def when_done(self, rid: str, fn: Callable[[], None]) -> None:
        """Run `fn` once the prompt's KV exists on this node (now, if it already does)."""
        job = self.jobs[rid]
        if job.done_at >= 0:
            fn()
        else:
            job.waiting.append(fn)

    def when_started(self, rid: str, fn: Callable[[PrefillJob], None]) -> None:
        """Run `fn(job)` once the job's compute is planned (now, if it is): from then on its
        `compute_start`, `compute_end` and `cached_tokens` say when each part of its KV exists,
        which a layer-wise transfer needs to start before prefill has ended."""
        job = self.jobs[rid]
        if job.compute_end >= 0:
            fn(job)
        else:
            job.starting.append(fn)

    def release(self, rid: str) -> None:
        """The decode node has everything it asked for: forget the job."""
        self.jobs.pop(rid, None)

    def _next(self) -> None:
        if not self.queue:
            self.busy = False
            return
        self.busy = True
        job = self.queue.popleft()
        now = self.loop.now
        job.started = now
        page = self.page
        ready = now
        plan = None
        planner = self.planner
        if planner is not None:
            plan = planner.match(job.keys, job.prompt_len, ("prefill", job.rid), now)
            l1, l2 = plan.device_pages, plan.host_pages
            if self.store is not None:
                cached = (l1 + l2) * page

                def read_s(pages: int) -> float:
                    return self._l3_read_seconds(pages, now)

                def compute_s(pages: int) -> float:
                    return self.costs.prefill_seconds(pages * page, cached)

                planner.take_l3(plan, self.store.prefix_hits(job.keys, l1 + l2), read_s, compute_s)
            l3 = plan.l3_pages
            if l2:
                ready = max(ready, self.host.reserve(now, l2 * page * self.kvb).done)
            if l3:
                read = self.store.channel.reserve(now, l3 * page * self.kvb)  # type: ignore[union-attr]
                self.store.touch(job.keys[l1 + l2 : l1 + l2 + l3])  # type: ignore[union-attr]
                ready = max(ready, self.host.reserve(read.done, l3 * page * self.kvb).done)
            job.cached_tokens = plan.cached_tokens(l1 + l2 + l3)
        compute = job.prompt_len - job.cached_tokens
        self.computed_tokens += compute
        self.cached_tokens += job.cached_tokens
        done = ready + self.costs.prefill_seconds(compute, job.cached_tokens) * job.scale
        job.compute_start, job.compute_end = ready, done
        self.loop.call_at(done, self._done, job, plan)
        starting, job.starting = job.starting, []
        for fn in starting:
            fn(job)

    def _l3_read_seconds(self, pages: int, now: float) -> float:
        """Queueing behind the storage channel's backlog, then the read and the host copy.

        The same rule the decode core's adaptive promise uses (`RestorePath`), built from the
        channels as they are now, so a prefill node and a decode node weigh a restore alike."""
        ch = self.store.channel  # type: ignore[union-attr]
        nbytes = pages * self.page * self.kvb
        queued = max(0.0, ch.free_at - now)
        path = RestorePath(
            latency=ch.latency,
            bandwidth=ch.bandwidth,
            hop_latency=self.host.latency,
            hop_bandwidth=self.host.bandwidth,
        )
        return path.seconds(nbytes, queued)

    def _done(self, job: PrefillJob, plan: PrefillPlan | None) -> None:
        job.done_at = self.loop.now
        if plan is not None:
            # Its pages are all here now: what the tree lacks on L1 enters it, room permitting.
            planner = self.planner
            assert planner is not None
            planner.restored(plan)
            planner.reserve(plan)
            planner.finish(plan, self.loop.now)
        waiting, job.waiting = job.waiting, []
        for fn in waiting:
            fn()
        self._next()
