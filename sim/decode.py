"""A decode node in the simulator: the real core, its commands executed against cost models.

The driver owns no cache decision. It feeds the core events (arrivals, scheduler ticks, I/O
completions, decode progress) and turns each command into simulated time on the node's
channels: load-backs on the host->device link, backups on device->host, prefetches and stores
on the shared storage channel, KV increments on the node's network ingress once the prefill
node has computed them. With `faults` (`hicache.sim.faults`) an operation may fail, fall short
or come late, as the runtime's do when faults are injected there.

Decoding is fast-forwarded. A step of the running batch takes a(B) + b * S seconds (see
`costs`); between changes of the batch's membership S grows by B per step, so the time of k
steps has a closed form and the driver only wakes when a request finishes, reaches a
progress report, or joins. A request joining mid-step starts at the next step boundary.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

import attrs

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.decode_node import DecodeNodeCore
from hicache.sim.channel import Channel, Transfer
from hicache.sim.costs import NodeCosts, steps_time, steps_within
from hicache.sim.engine import EventHandle, EventLoop
from hicache.sim.faults import SimFaults
from hicache.sim.prefill import PrefillNode
from hicache.sim.store import SharedStore


@attrs.define(slots=True, eq=False)
class LiveRequest:
    """What the driver knows of a request between its arrival and its answer."""

    rid: str
    prompt_len: int
    output_len: int
    seq_keys: list[int]  # full-page keys of prompt + output
    arrival: float
    prefill: PrefillNode
    first_token: float = -1.0  # the first StartDecode: prefill's token reaches the user
    finished: float = -1.0
    made: int = 0  # output tokens generated (the first comes from prefill)
    reported: int = 0  # output tokens whose KV the core has been told about
    pd_bytes: float = 0.0
    promised_tokens: int = -1
    prefill_cached: int = 0  # prompt tokens the prefill node did not compute
    # batch membership
    active: bool = False
    base_step: int = 0
    made_at_join: int = 0
    event_step: int = -1


class DecodeDriver:
    def __init__(
        self,
        index: int,
        loop: EventLoop,
        core: DecodeNodeCore,
        costs: NodeCosts,
        *,
        h2d: Channel,
        d2h: Channel,
        network: Channel,
        store: SharedStore | None,
        max_running: int,
        tick_interval: float,
        on_response: Callable[[LiveRequest, cmd.Respond], None],
        faults: SimFaults | None = None,
    ) -> None:
        self.index = index
        self.loop = loop
        self.core = core
        self.costs = costs
        self.page = core.cfg.page_size
        self.kvb = costs.model.kv_bytes_per_token
        self.h2d, self.d2h, self.network = h2d, d2h, network
        self.store = store
        self.max_running = max_running
        self.tick_interval = tick_interval
        self.on_response = on_response
        self.faults = faults
        self.flush_every = max(self.page, core.cfg.decode_reserve_tokens)
        self.live: dict[str, LiveRequest] = {}
        self.core_events = 0
        self._tick_due = False  # a Tick is scheduled
        self._prefetches: dict[int, tuple[cmd.Prefetch, Transfer, int, EventHandle]] = {}
        self._transfer_req: dict[int, str] = {}
        # the decode batch
        self.steps = 0  # steps the batch has run, ever
        self.boundary = 0.0  # the time at which `steps` completed
        self.batch = 0
        self.context = 0  # sum of the running requests' context lengths
        self._due: list[tuple[int, int, str]] = []
        self._seq = itertools.count()
        self._epoch: EventHandle | None = None
        self._epoch_k = 0
        self._joining: list[LiveRequest] = []
        self._waiting: deque[LiveRequest] = deque()
        self._a_cache: dict[int, float] = {}
        self._b = costs.step_per_context_token

    @property
    def load(self) -> int:
        return len(self.live)

    # ------------------------------------------------------------------ feeding the core

    def arrive(self, live: LiveRequest) -> None:
        self.live[live.rid] = live
        keys = live.seq_keys[: live.prompt_len // self.page]
        self._feed(ev.RequestArrived(self.loop.now, live.rid, live.prompt_len, keys))

    def _feed(self, event: ev.Event) -> None:
        self.core_events += 1
        out = self.core.handle(event)
        for c in out:
            self._run(c)
        if not isinstance(event, ev.Tick) and not self._tick_due:
            self._tick_due = True
            self.loop.call_after(self.tick_interval, self._on_tick)

    def _on_tick(self) -> None:
        self._tick_due = False
        self._feed(ev.Tick(self.loop.now))

    # ------------------------------------------------------------------ commands

    def _run(self, c: cmd.Command) -> None:
        now = self.loop.now
        page_bytes = self.page * self.kvb
        loop = self.loop
        if isinstance(c, cmd.RequestKV):
            live = self.live[c.req]
            if live.promised_tokens < 0:
                live.promised_tokens = c.start
            self._transfer_req[c.transfer] = c.req
            live.prefill.when_done(c.req, lambda: self._send(c))
        elif isinstance(c, cmd.StartDecode):
            self._join(self.live[c.req])
        elif isinstance(c, cmd.LoadBack):
            t = self.h2d.reserve(now, len(c.host_slots) * page_bytes)
            failed: tuple[str, ...] = ()
            delay = 0.0
            if self.faults is not None:
                failed, delay = self.faults.load(c, self._owners(c))
            loop.call_at(t.done + delay, self._load_done, c.op, failed)
        elif isinstance(c, cmd.Backup):
            t = self.d2h.reserve(now, len(c.device_slots) * page_bytes)
            delay = self.faults.backup(c) if self.faults is not None else 0.0
            loop.call_at(t.done + delay, self._feed_at, ev.BackupDone, c.op)
        elif isinstance(c, cmd.QueryStorage):
            assert self.store is not None
            hits = tuple((rid, self.store.prefix_hits(keys)) for rid, keys in c.queries)
            delay = 0.0
            if self.faults is not None:
                hits, delay = self.faults.query(c.op, hits)
            loop.call_at(now + self.store.channel.latency + delay, self._answer_query, c.op, hits)
        elif isinstance(c, cmd.Prefetch):
            assert self.store is not None
            avail = self.store.prefix_hits(c.keys)
            delay = 0.0
            if self.faults is not None:
                avail, delay = self.faults.prefetch(c, avail)
            self.store.touch(c.keys[:avail])
            t = self.store.channel.reserve(now, avail * page_bytes)
            handle = loop.at(t.done + delay, self._prefetch_done, c.op)
            self._prefetches[c.op] = (c, t, avail, handle)
        elif isinstance(c, cmd.CancelPrefetch):
            entry = self._prefetches.get(c.op)
            if entry is not None:
                _, t, avail, handle = entry
                handle.cancel()
                got = min(avail, int(avail * t.fraction_at(now)))
                self.store.channel.cut(t, now)  # type: ignore[union-attr]
                del self._prefetches[c.op]
                loop.call_at(now, self._feed_prefetch_done, c.op, got)
        elif isinstance(c, cmd.Store):
            assert self.store is not None
            t = self.store.channel.reserve(now, len(c.keys) * page_bytes)
            keys, delay = self.faults.store(c) if self.faults is not None else (c.keys, 0.0)
            loop.call_at(t.done + delay, self._store_done, c.op, keys)
        elif isinstance(c, cmd.SetTimer):
            at = self.faults.timer(c, now) if self.faults is not None else max(c.at, now)
            loop.call_at(at, self._feed_at, ev.TimerFired, c.timer)
        elif isinstance(c, cmd.Retract):
            self._leave(self.live[c.req])
        elif isinstance(c, cmd.Respond):
            live = self.live.pop(c.req)
            live.finished = now
            job = live.prefill.jobs.get(c.req)
            if job is not None:
                live.prefill_cached = job.cached_tokens
            live.prefill.release(c.req)
            self.on_response(live, c)
        else:  # Agree: the simulator runs one rank per node
            raise NotImplementedError(f"the simulator does not execute {type(c).__name__}")

    def _feed_at(self, kind: type, op: int) -> None:
        self._feed(kind(self.loop.now, op))

    def _owners(self, c: cmd.LoadBack) -> dict[int, str]:
        """The request each device slot of a load-back belongs to."""
        return {s: rid for rid in c.reqs for s in self.core.requests[rid].slots}

    def _load_done(self, op: int, failed: tuple[str, ...]) -> None:
        self._feed(ev.LoadDone(self.loop.now, op, failed))

    def _answer_query(self, op: int, hits: tuple[tuple[str, int], ...]) -> None:
        self._feed(ev.StorageQueried(self.loop.now, op, hits))

    def _prefetch_done(self, op: int) -> None:
        _, _, avail, _ = self._prefetches.pop(op)
        self._feed(ev.PrefetchDone(self.loop.now, op, avail))

    def _feed_prefetch_done(self, op: int, pages: int) -> None:
        self._feed(ev.PrefetchDone(self.loop.now, op, pages))

    def _store_done(self, op: int, keys: tuple[int, ...]) -> None:
        self.store.add(keys)  # type: ignore[union-attr]
        self._feed(ev.StoreDone(self.loop.now, op))

    def _send(self, c: cmd.RequestKV) -> None:
        """Prefill has the KV: ship [start, end) over this node's network ingress."""
        live = self.live.get(c.req)
        nbytes = (c.end - c.start) * self.kvb
        fault = self.faults.transfer(c) if self.faults is not None else None
        if fault is not None:
            nbytes *= fault.share
        if live is not None:
            live.pd_bytes += nbytes
        t = self.network.reserve(self.loop.now, nbytes)
        if fault is not None and fault.fail:
            self.loop.call_at(t.done + fault.delay, self._failed, c.req, c.transfer, fault.reason)
            return
        delay = fault.delay if fault is not None else 0.0
        self.loop.call_at(t.done + delay, self._arrived, c.req, c.transfer)

    def _arrived(self, rid: str, tid: int) -> None:
        self._transfer_req.pop(tid, None)
        self._feed(ev.KVArrived(self.loop.now, rid, tid))

    def _failed(self, rid: str, tid: int, reason: str) -> None:
        self._transfer_req.pop(tid, None)
        self._feed(ev.KVFailed(self.loop.now, rid, tid, reason))

    # ------------------------------------------------------------------ the decode batch

    def _a(self, batch: int) -> float:
        a = self._a_cache.get(batch)
        if a is None:
            a = self._a_cache[batch] = self.costs.step_constant(batch)
        return a

    def _join(self, live: LiveRequest) -> None:
        if live.first_token < 0:
            live.first_token = self.loop.now
            live.made = 1  # prefill's token
        if self.batch + len(self._joining) >= self.max_running:
            self._waiting.append(live)
            return
        self._enter(live)

    def _enter(self, live: LiveRequest) -> None:
        now = self.loop.now
        if self.batch == 0 and not self._joining:
            self.boundary = max(self.boundary, now)
            self._add(live)
            self._plan()
            return
        self._joining.append(live)
        if self._epoch is not None and self._epoch_k <= 1:
            return  # the driver wakes at the next step boundary anyway
        k = steps_within(self._a(self.batch), self._b, self.batch, self.context, now - self.boundary)
        if self._epoch is not None and k >= self._epoch_k:
            self._epoch.cancel()  # its wake-up is due now: handle it (and the join) at once
            self._on_epoch()
            return
        self._advance(k)
        self._epoch_k = 0
        self._schedule(1)

    def _add(self, live: LiveRequest) -> None:
        live.active = True
        live.base_step = self.steps
        live.made_at_join = live.made
        self.batch += 1
        self.context += live.prompt_len + live.made
        self._arm(live)

    def _arm(self, live: LiveRequest) -> None:
        """Queue the step at which the request next needs the driver's attention."""
        to_finish = live.output_len - live.made
        to_flush = self.flush_every - (live.made - 1 - live.reported)
        step = live.base_step + (live.made - live.made_at_join) + max(0, min(to_finish, to_flush))
        live.event_step = step
        heapq.heappush(self._due, (step, next(self._seq), live.rid))

    def _leave(self, live: LiveRequest) -> None:
        """Retracted: out of the batch; tokens without reported KV will be generated again."""
        if live in self._joining:
            self._joining.remove(live)
            return
        if live in self._waiting:
            self._waiting.remove(live)
            return
        if not live.active:
            return
        self._sync(live)
        live.active = False
        live.event_step = -1
        self.batch -= 1
        self.context -= live.prompt_len + live.made
        live.made = live.reported + 1

    def _sync(self, live: LiveRequest) -> None:
        live.made = live.made_at_join + (self.steps - live.base_step)

    def _advance(self, k: int) -> None:
        if k <= 0:
            return
        self.boundary += steps_time(self._a(self.batch), self._b, self.batch, self.context, k)
        self.steps += k
        self.context += self.batch * k

    def _schedule(self, k: int) -> None:
        if self._epoch is not None:
            self._epoch.cancel()
        t = self.boundary + steps_time(self._a(self.batch), self._b, self.batch, self.context, k)
        self._epoch_k = k
        self._epoch = self.loop.at(max(t, self.loop.now), self._on_epoch)

    def _plan(self) -> None:
        due = self._due
        while due and (self.live.get(due[0][2]) is None or self.live[due[0][2]].event_step != due[0][0]):
            heapq.heappop(due)  # stale: left the batch or re-armed
        if self.batch == 0 or not due:
            if self._epoch is not None:
                self._epoch.cancel()
            self._epoch = None
            return
        self._schedule(max(0, due[0][0] - self.steps))

    def _on_epoch(self) -> None:
        self._epoch = None
        self._advance(self._epoch_k)
        self._epoch_k = 0
        self.boundary = max(self.boundary, self.loop.now)
        due = self._due
        fired: list[LiveRequest] = []
        while due and due[0][0] <= self.steps:
            step, _, rid = heapq.heappop(due)
            live = self.live.get(rid)
            if live is not None and live.active and live.event_step == step:
                fired.append(live)
        for live in fired:
            if live.active:
                self._progress(live)
        joining, self._joining = self._joining, []
        while self._waiting and self.batch + len(joining) < self.max_running:
            joining.append(self._waiting.popleft())
        for live in joining:
            self._add(live)
        self._plan()

    def _progress(self, live: LiveRequest) -> None:
        """Tell the core about tokens whose KV now exists; finish the request at its end."""
        self._sync(live)
        page = self.page
        kv_tokens = live.made - 1  # the newest token's KV is computed by the next step
        new = kv_tokens - live.reported
        r = self.core.requests[live.rid]
        have = len(r.keys)
        want = (live.prompt_len + kv_tokens) // page
        keys = live.seq_keys[have:want] if want > have else []
        live.reported = kv_tokens
        done = live.made >= live.output_len
        if new or keys:
            self._feed(ev.Decoded(self.loop.now, live.rid, new, keys))
        if not live.active:
            return  # retracted by that report
        if done:
            live.active = False
            self.batch -= 1
            self.context -= live.prompt_len + live.made
            self._feed(ev.Finished(self.loop.now, live.rid))
        else:
            self._arm(live)
