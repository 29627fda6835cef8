"""A decode node in the simulator: the real core, its commands executed against cost models.

The driver owns no cache decision and reads nothing of the core but what its commands and
events carry. It feeds the core events (arrivals, scheduler ticks, I/O completions, decode
progress) through a `Dispatcher`, whose table turns each command into simulated time on the
node's channels: load-backs on the host->device link, backups on device->host, prefetches and
stores on the shared storage channel, KV increments on the node's network ingress, layer group by
layer group while prefill computes them (`layer_groups`) or once it has ended. With `faults`
(`hicache.sim.faults`) an operation may fail, fall short or come late, as the runtime's do when
faults are injected there.

The batch limit (`DecodeConfig.max_running`) is the core's: it hands the driver a request
(`StartDecode`) only when the batch has room, so the driver keeps no waiting queue.

Decoding is fast-forwarded. A step of the running batch takes a(B) + b * S seconds (see
`costs`); between changes of the batch's membership S grows by B per step, so the time of k
steps has a closed form and the driver only wakes when a request finishes, reaches a
progress report, or joins. A request joining mid-step starts at the next step boundary.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import attrs

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.dispatch import Dispatcher
from hicache.sim.channel import Channel, Transfer
from hicache.sim.costs import NodeCosts, steps_time, steps_within
from hicache.sim.engine import EventLoop
from hicache.sim.event_handle import EventHandle
from hicache.sim.faults import SimFaults, TransferFault
from hicache.sim.prefill import PrefillJob, PrefillNode
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
    first_token: float = -1.0  # when the first StartDecode's KV was complete: prefill's token is out
    finished: float = -1.0
    made: int = 0  # output tokens generated (the first comes from prefill)
    reported: int = 0  # output tokens whose KV the core has been told about
    pd_bytes: float = 0.0
    promised_tokens: int = -1  # tokens its first admission restored locally (StartDecode)
    prefill_cached: int = 0  # prompt tokens the prefill node did not compute
    # batch membership
    active: bool = False
    base_step: int = 0
    made_at_join: int = 0
    event_step: int = -1


class DecodeDriver:
    """Executes one decode node's commands on the event loop and runs its decode batch."""

    def __init__(
        self,
        index: int,
        loop: EventLoop,
        config: DecodeConfig,
        costs: NodeCosts,
        *,
        h2d: Channel,
        d2h: Channel,
        network: Channel,
        store: SharedStore | None,
        tick_interval: float,
        on_response: Callable[[LiveRequest, cmd.Respond], None],
        faults: SimFaults | None = None,
        layer_groups: int = 0,
    ) -> None:
        self.index = index
        self.loop = loop
        self.core = DecodeNodeCore(config)
        self.costs = costs
        self.page = config.page_size
        self.kvb = costs.model.kv_bytes_per_token
        self.page_bytes = self.page * self.kvb
        self.h2d, self.d2h, self.network = h2d, d2h, network
        self.store = store
        self.tick_interval = tick_interval
        self.on_response = on_response
        self.faults = faults
        self.layer_groups = layer_groups  # > 0: P->D transfers stream in that many groups
        self.flush_every = max(self.page, config.decode_reserve_tokens)
        self.live: dict[str, LiveRequest] = {}
        self._prefetches: dict[int, tuple[cmd.Prefetch, Transfer, int, EventHandle]] = {}
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
        self._in_epoch = False  # at a step boundary, handling it: a join waits for its end
        self._a_cache: dict[int, float] = {}
        self._b = costs.step_per_context_token
        self.dispatcher = Dispatcher(
            self.core,
            {
                cmd.Backup: self._backup,
                cmd.Store: self._store,
                cmd.QueryStorage: self._query,
                cmd.Prefetch: self._prefetch,
                cmd.CancelPrefetch: self._cancel_prefetch,
                cmd.LoadBack: self._load_back,
                cmd.RequestKV: self._request_kv,
                cmd.SetTimer: self._set_timer,
                cmd.Agree: self._agree,
                cmd.StartDecode: self._start_decode,
                cmd.ExtendKV: self._extend_kv,
                cmd.Retract: self._retract,
                cmd.Respond: self._respond,
            },
            f"simulator decode node {index}",
        )

    @property
    def load(self) -> int:
        return len(self.live)

    @property
    def core_events(self) -> int:
        """Events fed to the core so far."""
        return self.dispatcher.events

    @property
    def running(self) -> int:
        """Requests in the decode batch, including those joining at the next step boundary."""
        return self.batch + len(self._joining)

    # ------------------------------------------------------------------ feeding the core

    def arrive(self, live: LiveRequest) -> None:
        self.live[live.rid] = live
        keys = live.seq_keys[: live.prompt_len // self.page]
        self._feed(ev.RequestArrived(self.loop.now, live.rid, live.prompt_len, keys))

    def _feed(self, event: ev.Event) -> None:
        if self.dispatcher.feed(event):
            self.loop.call_after(self.tick_interval, self._on_tick)

    def _on_tick(self) -> None:
        self.dispatcher.tick(self.loop.now)

    def _feed_at(self, kind: type, op: int) -> None:
        self._feed(kind(self.loop.now, op))

    # ------------------------------------------------------------------ commands: copies and storage

    def _load_back(self, c: cmd.LoadBack) -> None:
        t = self.h2d.reserve(self.loop.now, len(c.host_slots) * self.page_bytes)
        failed: tuple[int, ...] = ()
        delay = 0.0
        if self.faults is not None:
            failed, delay = self.faults.load(c)
        self.loop.call_at(t.done + delay, self._load_done, c.op, failed)

    def _load_done(self, op: int, failed: tuple[int, ...]) -> None:
        self._feed(ev.LoadDone(self.loop.now, op, failed))

    def _backup(self, c: cmd.Backup) -> None:
        t = self.d2h.reserve(self.loop.now, len(c.device_slots) * self.page_bytes)
        failed, delay = self.faults.backup(c) if self.faults is not None else ((), 0.0)
        self.loop.call_at(t.done + delay, self._backup_done, c.op, failed)

    def _backup_done(self, op: int, failed: tuple[int, ...]) -> None:
        self._feed(ev.BackupDone(self.loop.now, op, failed))

    def _query(self, c: cmd.QueryStorage) -> None:
        assert self.store is not None
        hits = tuple((rid, self.store.prefix_hits(keys)) for rid, keys in c.queries)
        delay = 0.0
        if self.faults is not None:
            hits, delay = self.faults.query(c, hits)
        self.loop.call_at(self.loop.now + self.store.channel.latency + delay, self._answer_query, c.op, hits)

    def _answer_query(self, op: int, hits: tuple[tuple[str, int], ...]) -> None:
        self._feed(ev.StorageQueried(self.loop.now, op, hits))

    def _prefetch(self, c: cmd.Prefetch) -> None:
        assert self.store is not None
        avail = self.store.prefix_hits(c.keys)
        delay = 0.0
        if self.faults is not None:
            avail, delay = self.faults.prefetch(c, avail)
        self.store.touch(c.keys[:avail])
        t = self.store.channel.reserve(self.loop.now, avail * self.page_bytes)
        handle = self.loop.at(t.done + delay, self._prefetch_done, c.op)
        self._prefetches[c.op] = (c, t, avail, handle)

    def _prefetch_done(self, op: int) -> None:
        _, _, avail, _ = self._prefetches.pop(op)
        self._feed(ev.PrefetchDone(self.loop.now, op, avail))

    def _cancel_prefetch(self, c: cmd.CancelPrefetch) -> None:
        """Cut the read short; one that has ended already is ignored (its done is on its way)."""
        entry = self._prefetches.pop(c.op, None)
        if entry is None:
            return
        now = self.loop.now
        _, t, avail, handle = entry
        handle.cancel()
        got = min(avail, int(avail * t.fraction_at(now)))
        self.store.channel.cut(t, now)  # type: ignore[union-attr]
        self.loop.call_at(now, self._feed_prefetch_done, c.op, got)

    def _feed_prefetch_done(self, op: int, pages: int) -> None:
        self._feed(ev.PrefetchDone(self.loop.now, op, pages))

    def _store(self, c: cmd.Store) -> None:
        assert self.store is not None
        t = self.store.channel.reserve(self.loop.now, len(c.keys) * self.page_bytes)
        written, delay = self.faults.store(c) if self.faults is not None else (c.keys, 0.0)
        self.loop.call_at(t.done + delay, self._store_done, c, written)

    def _store_done(self, c: cmd.Store, written: tuple[int, ...]) -> None:
        """Storage holds `written` now; the Store's other pages are reported failed."""
        self.store.add(written)  # type: ignore[union-attr]
        failed: tuple[int, ...] = ()
        if len(written) != len(c.keys):
            held = set(written)
            failed = tuple(i for i, k in enumerate(c.keys) if k not in held)
        self._feed(ev.StoreDone(self.loop.now, c.op, failed))

    def _set_timer(self, c: cmd.SetTimer) -> None:
        now = self.loop.now
        at = self.faults.timer(c, now) if self.faults is not None else max(c.at, now)
        self.loop.call_at(at, self._feed_at, ev.TimerFired, c.timer)

    def _agree(self, c: cmd.Agree) -> None:
        raise NotImplementedError(
            f"the simulator runs one TP rank per decode node (tp_size=1), so it cannot execute "
            f"{type(c).__name__} #{c.agreement} ({c.kind})"
        )

    # ------------------------------------------------------------------ commands: P->D transfers

    def _request_kv(self, c: cmd.RequestKV) -> None:
        live = self.live[c.req]
        if self.faults is not None:
            self.faults.issue_transfer(c)
        if self.layer_groups > 0:
            live.prefill.when_started(c.req, lambda job: self._send(c, job))
        else:
            live.prefill.when_done(c.req, lambda: self._send(c))

    def _send(self, c: cmd.RequestKV, job: PrefillJob | None = None) -> None:
        """Ship [start, end) over this node's network ingress: at once if prefill has the KV,
        else streamed as `job` computes it (what it restored first, then layer group by group)."""
        live = self.live.get(c.req)
        nbytes = float((c.end - c.start) * self.kvb)
        fault = self.faults.transfer(c) if self.faults is not None else None
        share = fault.share if fault is not None else 1.0
        nbytes *= share
        if live is not None:
            live.pd_bytes += nbytes
        now = self.loop.now
        if job is None or now >= job.compute_end:
            self._ship(c, fault, self.network.reserve(now, nbytes))
            return
        head = max(0, min(c.end, job.cached_tokens) - c.start) * self.kvb
        body = (c.end - c.start) * self.kvb - head
        ps, pe = job.compute_start, job.compute_end
        # The link stays free for others until the transfer can go out without a pause.
        at = self.network.stream_start(head, body, ps, pe, self.layer_groups)
        if at > now:
            self.loop.call_at(at, self._stream, c, fault, head, body, ps, pe, share)
        else:
            self._stream(c, fault, head, body, ps, pe, share)

    def _stream(
        self,
        c: cmd.RequestKV,
        fault: TransferFault | None,
        head: float,
        body: float,
        ps: float,
        pe: float,
        share: float,
    ) -> None:
        t = self.network.stream(self.loop.now, head, body, ps, pe, self.layer_groups, share)
        self._ship(c, fault, t)

    def _ship(self, c: cmd.RequestKV, fault: TransferFault | None, t: Transfer) -> None:
        """The transfer's bytes are booked on the link: it arrives, or fails, when they land."""
        if fault is not None and fault.fail:
            self.loop.call_at(t.done + fault.delay, self._failed, c.req, c.transfer, fault.reason)
            return
        delay = fault.delay if fault is not None else 0.0
        self.loop.call_at(t.done + delay, self._arrived, c.req, c.transfer)

    def _arrived(self, rid: str, tid: int) -> None:
        self._feed(ev.KVArrived(self.loop.now, rid, tid))

    def _failed(self, rid: str, tid: int, reason: str) -> None:
        self._feed(ev.KVFailed(self.loop.now, rid, tid, reason))

    # ------------------------------------------------------------------ commands: the batch and answers

    def _start_decode(self, c: cmd.StartDecode) -> None:
        """The core made room for the request: it joins the batch at the next step boundary."""
        live = self.live[c.req]
        if live.first_token < 0:
            live.first_token = c.ready_at  # prefill's token is out once the KV is complete
            live.made = 1  # prefill's token
            live.promised_tokens = c.promised  # what its first admission restored locally
        self._enter(live)

    def _extend_kv(self, c: cmd.ExtendKV) -> None:
        """New pages for a running request: the simulator models KV bytes, not where they go."""

    def _retract(self, c: cmd.Retract) -> None:
        self._leave(self.live[c.req])

    def _respond(self, c: cmd.Respond) -> None:
        """Record the answer, hand it on, then let the core forget the request (the core waits
        by itself until no I/O refers to it)."""
        live = self.live.pop(c.req)
        live.finished = self.loop.now
        job = live.prefill.jobs.get(c.req)
        if job is not None:
            live.prefill_cached = job.cached_tokens
        live.prefill.release(c.req)
        self.on_response(live, c)
        self._feed(ev.ForgetRequested(self.loop.now, c.req))

    # ------------------------------------------------------------------ the decode batch

    def _a(self, batch: int) -> float:
        a = self._a_cache.get(batch)
        if a is None:
            a = self._a_cache[batch] = self.costs.step_constant(batch)
        return a

    def _enter(self, live: LiveRequest) -> None:
        if self._in_epoch:
            # Started because a request finished at this boundary: it joins as the epoch ends.
            self._joining.append(live)
            return
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
        self._in_epoch = True
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
        self._in_epoch = False
        # Requests the core started meanwhile (a finish made room) joined `_joining`.
        joining, self._joining = self._joining, []
        for live in joining:
            self._add(live)
        self._plan()

    def _progress(self, live: LiveRequest) -> None:
        """Tell the core about tokens whose KV now exists; finish the request at its end."""
        self._sync(live)
        page = self.page
        kv_tokens = live.made - 1  # the newest token's KV is computed by the next step
        new = kv_tokens - live.reported
        # The keys reported so far cover the full pages of the prompt and the reported tokens.
        have = (live.prompt_len + live.reported) // page
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
