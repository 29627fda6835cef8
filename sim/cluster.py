"""A prefill/decode cluster replaying a workload: routers, prefill nodes, decode nodes running
the core, the shared L3, and the channels between them, all on one event loop."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import attrs
import numpy as np

from hicache.core import commands as cmd
from hicache.core.config import DecodeConfig
from hicache.core.door_slots import Slots
from hicache.core.router import Router
from hicache.faults import FaultSpec
from hicache.results import RequestRecord, RunTally, summarize
from hicache.scenarios.workload import WorkItem
from hicache.sim.channel import Channel, lanes_for
from hicache.sim.costs import NodeCosts
from hicache.sim.decode import DecodeDriver, LiveRequest
from hicache.sim.engine import EventLoop
from hicache.sim.faults import SimFaults
from hicache.sim.prefill import PrefillJob, PrefillNode
from hicache.sim.sessions import ClosedLoop
from hicache.sim.store import SharedStore

DOOR_QUEUE = 1 << 62  # the front door's queue: unbounded


@attrs.frozen(slots=True)
class ClusterSetup:
    """Everything a run needs, resolved: costs, channel speeds, node counts, the core's config.
    Bandwidths are bytes/s per node (already multiplied by the GPUs of a node)."""

    costs: NodeCosts
    decode: DecodeConfig
    model_name: str = "model"  # the page-key namespace
    prefill_nodes: int = 1
    decode_nodes: int = 1
    router: str = "round_robin"
    prefill_cache_pages: tuple[int, int] | None = None  # (L1, L2) pages per prefill node
    host_bandwidth: float = 63e9
    host_latency: float = 10e-6
    network_bandwidth: float = 50e9
    network_latency: float = 5e-6
    # P->D transfers: each on its own connection capped at `transfer_rate` (bytes/s; None: only
    # the link caps it). Whether they stream by layer group is the core's `transfer_groups`.
    transfer_rate: float | None = None
    storage_bandwidth: float = 10e9
    storage_latency: float = 2e-3
    storage_capacity_pages: int = 0
    tick_interval: float = 0.002
    faults: FaultSpec | None = None  # injected into every decode node's operations
    # The front door (`cluster.front_door_running`; 0: none): requests at the decode nodes at
    # once, and the L1 tokens they may hold together (0: not counted).
    door_max_running: int = 0
    door_max_tokens: int = 0


@attrs.define(slots=True)
class RunResult:
    records: list[RequestRecord]
    summary: dict
    channels: dict[str, dict[str, float]]


class Cluster:
    def __init__(self, setup: ClusterSetup) -> None:
        self.setup = setup
        self.loop = EventLoop()
        s = setup
        cfg = s.decode
        store = None
        if cfg.storage or s.prefill_cache_pages is not None:
            store = SharedStore(
                Channel("L3", s.storage_bandwidth, s.storage_latency), s.storage_capacity_pages
            )
        self.store = store
        self.prefill = [
            PrefillNode(
                i,
                self.loop,
                s.costs,
                page_size=cfg.page_size,
                host=Channel(f"P{i}.h2d", s.host_bandwidth, s.host_latency),
                store=store,
                cache_pages=s.prefill_cache_pages,
            )
            for i in range(s.prefill_nodes)
        ]
        self.decode = [
            DecodeDriver(
                i,
                self.loop,
                cfg,
                s.costs,
                h2d=Channel(f"D{i}.h2d", s.host_bandwidth, s.host_latency),
                d2h=Channel(f"D{i}.d2h", s.host_bandwidth, s.host_latency),
                network=Channel(
                    f"D{i}.net",
                    s.network_bandwidth,
                    s.network_latency,
                    lanes=lanes_for(s.network_bandwidth, s.transfer_rate),
                ),
                store=store if cfg.storage else None,
                tick_interval=s.tick_interval,
                on_response=self._respond,
                faults=SimFaults(s.faults, i) if s.faults is not None else None,
                layer_groups=cfg.transfer_groups,  # the groups the core's estimates assume
            )
            for i in range(s.decode_nodes)
        ]
        self.prefill_router = Router(s.router, s.prefill_nodes)
        self.decode_router = Router(s.router, s.decode_nodes)
        self.records: list[RequestRecord] = []
        self._items: dict[str, WorkItem] = {}
        self._nodes: dict[str, tuple[int, int]] = {}
        self._progress: Callable[[int], None] | None = None
        self._sequential = False
        self._keys: Mapping[str, np.ndarray] | None = None
        self.sessions: ClosedLoop | None = None
        self._on_record: Callable[[RequestRecord], None] | None = None
        self._tally: RunTally | None = None
        self._streamed = False
        # The front door (None: none), as `hicache serve`'s admission decides; its queue never
        # refuses (a replay has no client to answer 503). The requests waiting at it, and each
        # request's arrival there, for its record.
        self._door: Slots | None = None
        if s.door_max_running > 0:
            self._door = Slots(s.door_max_running, DOOR_QUEUE, s.door_max_tokens)
        self._door_waiting: dict[str, WorkItem] = {}
        self._door_arrival: dict[str, float] = {}
        # When a list: each door event as (what, request, requests let in, their tokens) just
        # after it, what being "arrive", "enter" or "leave" (for tests and traces).
        self.door_log: list[tuple[str, str, int, int]] | None = None

    def run(
        self,
        items: Iterable[WorkItem],
        progress: Callable[[int], None] | None = None,
        *,
        sequential: bool = False,
        keys: Mapping[str, np.ndarray] | None = None,
        clients: int = 0,
        until: float = 0.0,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> RunResult:
        """Replay `items` (sorted by arrival) to the end; `progress(n)` hears of n more answers.
        `sequential`: each request arrives only once the one before has ended and every node is
        at rest (its backups and stores done): the decisions of one request at a time (pauses
        of closed-loop sessions are then ignored).
        `keys`: each item's sequence page keys, when a caller replays the same items several
        times (otherwise computed at arrival).
        Closed-loop requests (`WorkItem.think` set) are sent when the one before them in their
        session is answered, `think` seconds later; `clients` caps the sessions open at once and
        nothing is sent at or after `until` (see `hicache.sim.sessions`).
        `on_record`: hears each request's record when it ends, and the run keeps none (its
        `records` come back empty; the summary is the same): with `items` an iterator, memory
        then holds only what is in flight and the caches, whatever the workload's length. An
        iterator of items is replayed open-loop."""
        self._progress = progress
        self._keys = keys
        self._on_record = on_record
        self._tally = RunTally() if on_record is not None else None
        page = self.setup.decode.page_size
        model = self.setup.model_name
        self._streamed = not isinstance(items, Sequence)
        if not isinstance(items, Sequence):
            if clients > 0:
                raise ValueError("a closed loop (clients > 0) needs its items as a sequence")
        elif not sequential and (clients > 0 or any(i.think is not None for i in items)):
            self.sessions = ClosedLoop(items, clients, until)
            items = self.sessions.firsts
        arrivals = iter(items)
        self._sequential = sequential
        first = next(arrivals, None)
        if first is not None:
            self.loop.call_at(first.arrival, self._arrive, first, arrivals, page, model)
        start = time.perf_counter()
        self.loop.run()
        wall = time.perf_counter() - start
        for d in self.decode:
            d.core.check()
            if d.live or not d.core.idle:
                raise RuntimeError(f"decode node {d.index} did not come to rest: {len(d.live)} requests live")
        self.records.sort(key=lambda r: (r.arrival, r.id))
        events = self.loop.events_run
        if self._tally is not None:
            summary = self._tally.summary(events=events, wall_s=wall, sim_s=self.loop.now)
        else:
            summary = summarize(self.records, events=events, wall_s=wall, sim_s=self.loop.now)
        summary["core_events"] = sum(d.core_events for d in self.decode)
        if self.setup.faults is not None:
            injected: Counter[str] = Counter()
            for d in self.decode:
                injected.update(d.faults.injected if d.faults is not None else {})
            summary["faults_injected"] = dict(sorted(injected.items()))
        channels = {}
        for c in self._channels():
            channels[c.name] = {
                "bytes": c.bytes_moved,
                "transfers": c.transfers,
                "utilization": c.busy_time / self.loop.now if self.loop.now > 0 else 0.0,
            }
        return RunResult(self.records, summary, channels)

    def _channels(self) -> list[Channel]:
        out = [p.host for p in self.prefill]
        for d in self.decode:
            out += [d.h2d, d.d2h, d.network]
        if self.store is not None:
            out.append(self.store.channel)
        return out

    def _arrive(self, item: WorkItem, arrivals: Iterator[WorkItem], page: int, model: str) -> None:
        # Arrivals are scheduled one ahead, which keeps the event heap small.
        if self._sequential:
            self.loop.call_after(self.setup.tick_interval, self._when_rested, arrivals, page, model)
        else:
            after = next(arrivals, None)
            if after is not None:
                self.loop.call_at(
                    max(after.arrival, self.loop.now), self._arrive, after, arrivals, page, model
                )
        if self.sessions is not None and not self.sessions.arrived(item, self.loop.now):
            return  # every client is busy (the session waits for one), or it is past `until`
        self._send(item, page, model)

    def _due(self, item: WorkItem) -> None:
        """A closed-loop request's time has come (or a waiting session got its client)."""
        assert self.sessions is not None
        start = self.sessions.due(item, self.loop.now)
        if start is None:
            self._send(item, self.setup.decode.page_size, self.setup.model_name)
        else:
            self._schedule(start)

    def _schedule(self, items: list[tuple[float, WorkItem]]) -> None:
        for delay, item in items:
            self.loop.call_after(delay, self._due, item)

    def _send(self, item: WorkItem, page: int, model: str) -> None:
        if item.think is not None and self._streamed and not self._sequential:
            raise ValueError(
                f"request {item.id} is closed-loop (think set), but the items came as an iterator"
            )
        door = self._door
        if door is None:
            self._dispatch(item, page, model)
            return
        self._door_arrival[item.id] = self.loop.now
        self._door_note("arrive", item.id)
        need = item.prompt_len + min(max(1, item.output_len), self.setup.decode.decode_reserve_tokens)
        if door.arrive(item.id, need) == "run":
            self._door_enter(item)
        else:
            self._door_waiting[item.id] = item

    def _door_enter(self, item: WorkItem) -> None:
        self._door_note("enter", item.id)
        self._dispatch(item, self.setup.decode.page_size, self.setup.model_name)

    def _door_leave(self, rid: str) -> None:
        """A request ended: the heads of the door's queue that fit now go in, in order."""
        door = self._door
        if door is None or rid not in door.held:
            return
        if self.door_log is not None:  # as it leaves, before the requests behind it go in
            self.door_log.append(("leave", rid, door.running - 1, door.tokens - door.held[rid]))
        for queued in door.leave(rid):
            self._door_enter(self._door_waiting.pop(str(queued)))

    def _door_note(self, what: str, rid: str) -> None:
        if self.door_log is not None and self._door is not None:
            self.door_log.append((what, rid, self._door.running, self._door.tokens))

    def _dispatch(self, item: WorkItem, page: int, model: str) -> None:
        keys = self._keys[item.id] if self._keys is not None else item.sequence_keys(page, model)
        seq = keys.tolist()
        prompt = tuple(seq[: item.prompt_len // page])  # the form the trees compare: converted once
        p = self.prefill_router.choose(
            item.session, [n.load for n in self.prefill], lambda i: self.prefill[i].peek(prompt)
        )
        d = self.decode_router.choose(
            item.session, [n.load for n in self.decode], lambda i: self.decode[i].core.cached_pages(prompt)
        )
        self._items[item.id] = item
        self._nodes[item.id] = (p, d)
        node = self.prefill[p]
        node.submit(PrefillJob(item.id, item.prompt_len, prompt, self.loop.now, scale=item.service_scale))
        live = LiveRequest(item.id, item.prompt_len, max(1, item.output_len), seq, self.loop.now, node)
        self.decode[d].arrive(live)

    def _when_rested(self, arrivals: Iterator[WorkItem], page: int, model: str) -> None:
        if any(d.live or not d.core.idle for d in self.decode) or any(p.load for p in self.prefill):
            self.loop.call_after(self.setup.tick_interval, self._when_rested, arrivals, page, model)
            return
        after = next(arrivals, None)
        if after is not None:
            self._arrive(after, arrivals, page, model)

    def _respond(self, live: LiveRequest, c: cmd.Respond) -> None:
        item = self._items.pop(live.rid)
        p, d = self._nodes.pop(live.rid)
        a = c.account  # where the prompt's KV came from (the last admission)
        ok = c.outcome == "finished"
        arrival = self._door_arrival.pop(live.rid, live.arrival)  # at the front door, if any
        ttft = live.first_token - arrival if live.first_token >= 0 else math.nan
        tpot = (
            (live.finished - live.first_token) / (live.output_len - 1)
            if ok and live.output_len > 1
            else math.nan
        )
        record = RequestRecord(
            id=live.rid,
            session=item.session,
            turn=item.turn,
            arrival=arrival,
            prefill_node=p,
            decode_node=d,
            prompt_tokens=item.prompt_len,
            output_tokens=live.output_len,
            outcome=c.outcome,
            reason=c.reason,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=live.finished - arrival,
            cached_l1=a.l1,
            cached_l2=a.l2,
            cached_l3=a.l3,
            transferred_tokens=a.transferred,
            promised_tokens=max(0, live.promised_tokens),
            fallback_tokens=a.fallback,
            prefill_cached_tokens=live.prefill_cached,
            pd_transfer_bytes=live.pd_bytes,
            retractions=a.retractions,
        )
        if self._tally is not None:
            assert self._on_record is not None
            self._tally.add(record)
            self._on_record(record)
        else:
            self.records.append(record)
        if self._progress is not None:
            self._progress(1)
        if self.sessions is not None:
            self._schedule(self.sessions.answered(live.rid))
        self._door_leave(live.rid)
