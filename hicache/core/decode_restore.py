"""The restore track: prefetches L3 -> L2 (settled by the prefetch policy, with several ranks
on agreed progress) and merged load-backs L2 -> L1, at most `load_batches_in_flight` in flight.
What a restore falls short of is asked of prefill (`fallback`); bad L2 pages leave the tree."""

from __future__ import annotations

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.commands import TimerKind
from hicache.core.decode_ops import LoadOp, LoadOpEntry, PrefetchOp
from hicache.core.decode_transfer import DecodeTransfer
from hicache.core.errors import CoreError
from hicache.core.failed_pages import failed_pages
from hicache.core.lifecycles import LOAD, PREFETCH, LoadPhase, PrefetchPhase, Step, advance
from hicache.core.prefetch_rule import prefetch_should_stop
from hicache.core.request import Request


class DecodeRestore(DecodeTransfer):
    """Prefetch from L3, load back from L2, and the timers of both tracks."""

    # ------------------------------------------------------------------ prefetch L3 -> L2

    def _prefetch(self, e: ev.PrefetchProgress | ev.PrefetchDone) -> PrefetchOp:
        p = self._prefetches.get(e.op)
        if p is None:
            raise CoreError(f"{type(e).__name__}: no prefetch #{e.op} is in flight")
        if not isinstance(e.pages, int) or isinstance(e.pages, bool) or e.pages < 0:
            raise CoreError(f"{type(e).__name__} #{e.op}: pages must be an integer >= 0, got {e.pages!r}")
        advance(PREFETCH, p.phase, type(e), p.req, f"prefetch #{p.op}")  # refuse before any change
        return p

    def _on_prefetch_progress(self, e: ev.PrefetchProgress) -> None:
        p = self._prefetch(e)
        p.move(ev.PrefetchProgress)
        p.progress = max(p.progress, min(e.pages, p.planned))

    def _on_prefetch_done(self, e: ev.PrefetchDone) -> None:
        p = self._prefetch(e)
        p.move(ev.PrefetchDone)
        p.progress = max(p.progress, min(e.pages, p.planned))

    def _on_timer(self, e: ev.TimerFired) -> None:
        entry = self._timers.get(e.timer)
        if entry is None:
            raise CoreError(f"TimerFired: no timer #{e.timer} is set")
        kind, op = entry
        if kind is TimerKind.TRANSFER_RETRY:
            t = self._transfers.get(op)
            if t is not None:  # else its request ended during the backoff: dropped unsent
                phase = t.next_phase(ev.TimerFired)
                del self._timers[e.timer]
                t.phase = phase
                self._send(self.requests[t.req], t)
                return
        else:
            p = self._prefetches.get(op)
            if p is not None:  # else the prefetch ended before its deadline
                p.move(ev.TimerFired)
                p.timed_out = True
        del self._timers[e.timer]

    def _prefetch_values(self) -> dict:
        out = {}
        for p in self._prefetches.values():
            out[("progress", p.op)] = p.progress
            out[("final", p.op)] = int(p.phase.done)
        return out

    def _on_prefetch_agreed(self, values: dict) -> None:
        for p in list(self._prefetches.values()):
            if ("progress", p.op) not in values:
                continue
            got = min(values[("progress", p.op)], p.planned)
            ended = bool(values[("final", p.op)])
            if p.phase in (PrefetchPhase.OPEN, PrefetchPhase.OPEN_DONE):
                r = self.requests[p.req]
                stop = prefetch_should_stop(
                    self.cfg.prefetch_policy,
                    progress=got,
                    planned=p.planned,
                    ended=ended,
                    timed_out=p.timed_out,
                    schedulable=r.promised_pages >= 0 and not r.transfers,
                )
                if stop:
                    if not ended and got < p.planned:
                        self._emit(cmd.CancelPrefetch(p.op))
                    self._settle(p, got)
            if ended:
                p.move(Step.END)
                if p.claims:
                    self.host_pool.free(p.claims, ("op", p.op))
                    p.claims = []
                del self._prefetches[p.op]

    def _settle(self, p: PrefetchOp, fetched: int) -> None:
        """Fix how much of a prefetch the request uses; re-request the rest from prefill."""
        p.move(Step.SETTLE)
        r = self.requests[p.req]
        page = self.cfg.page_size
        r.prefetch_open = False
        rest = r.prefetch_slots[fetched:]
        if rest:
            self.host_pool.transfer(rest, r.owner, ("op", p.op))
            p.claims.extend(rest)
        r.prefetch_slots = r.prefetch_slots[:fetched]
        first = r.device_pages + r.l2_pages
        if fetched:
            self._queue_load(r, False, first, r.prefetch_slots)
        if r.promised_pages < 0:
            self._promise(r, first + fetched)  # confirmed: promise what is in L2 now
        elif fetched < p.planned:
            self._request_kv(r, (first + fetched) * page, (first + p.planned) * page, fallback=True)
        self._maybe_ready(r)

    # ------------------------------------------------------------------ load-back L2 -> L1

    def _queue_load(self, r: Request, from_l2: bool, first: int, host: list[int]) -> None:
        r.loads += 1
        device = r.slots[first : first + len(host)]
        anchor = r.pin.node if from_l2 and r.pin is not None else None
        self._load_queue.append(LoadOpEntry(r.id, from_l2, first, list(host), device, anchor))

    def _issue_loads(self) -> None:
        """All restores ready this tick go into one merged LoadBack, up to K batches in flight."""
        if not self._load_queue or len(self._loads) >= self.cfg.load_batches_in_flight:
            return
        entries, self._load_queue = self._load_queue, []
        op = next(self._ids)
        self._loads[op] = LoadOp(op, entries)
        self.stats.load_batches += 1
        self.stats.max_loads_in_flight = max(self.stats.max_loads_in_flight, len(self._loads))
        out = tuple(cmd.LoadEntry(e.req, tuple(e.host_slots), tuple(e.device_slots)) for e in entries)
        self._emit(cmd.LoadBack(op, out))

    def _on_load_done(self, e: ev.LoadDone) -> None:
        load = self._loads.get(e.op)
        if load is None:
            raise CoreError(f"LoadDone: no load-back #{e.op} is in flight")
        advance(LOAD, load.phase, ev.LoadDone, "", f"load-back #{e.op}")
        total = sum(len(x.host_slots) for x in load.entries)
        bad = sorted(set(failed_pages(e.failed, total, f"LoadDone #{e.op}")))
        load.move(ev.LoadDone)
        start = 0
        for i, entry in enumerate(load.entries):
            n = len(entry.host_slots)
            first = next((j - start for j in bad if start <= j < start + n), None)
            if first is not None:
                load.first_bad[i] = first
            start += n
        if self.cfg.tp_size == 1:
            self._finish_load(load, load.first_bad)
        # With several ranks a load's outcome may differ between them (one rank's copy fails):
        # the next tick agrees on it, and every rank falls back for the same pages.

    def _load_values(self) -> dict[tuple[object, ...], int]:
        out: dict[tuple[object, ...], int] = {}
        for load in self._loads.values():
            out[("done", load.op)] = int(load.phase is LoadPhase.COPIED)
            for i, entry in enumerate(load.entries):
                out[("ok", load.op, i)] = load.first_bad.get(i, len(entry.host_slots))
        return out

    def _on_load_agreed(self, values: dict) -> None:
        for load in list(self._loads.values()):
            if values.get(("done", load.op)) != 1:
                continue  # some rank's copy is still running
            first_bad = {
                i: k
                for i, entry in enumerate(load.entries)
                if (k := values.get(("ok", load.op, i), len(entry.host_slots))) < len(entry.host_slots)
            }
            self._finish_load(load, first_bad)

    def _finish_load(self, load: LoadOp, first_bad: dict[int, int]) -> None:
        """A load-back ended on every rank: account what arrived, fall back for the rest (from
        each entry's first bad page on), and drop bad L2 pages from the tree."""
        load.move(Step.END)
        del self._loads[load.op]
        page = self.cfg.page_size
        # Bad L2 pages leave the tree first, while every entry's pin still holds its span: two
        # entries may share an anchor, which the first drop cuts out of the tree.
        for i, entry in enumerate(load.entries):
            n = len(entry.host_slots)
            good = min(first_bad.get(i, n), n)
            if good < n and entry.from_l2 and entry.anchor is not None:
                self.stats.bad_l2_pages += 1
                self.tree.drop_host(entry.anchor, entry.first_page + good, entry.host_slots[good])
        for i, entry in enumerate(load.entries):
            n = len(entry.host_slots)
            good = min(first_bad.get(i, n), n)
            if not entry.orphaned:
                r = self.requests[entry.req]
                if good < n:
                    start, end = (entry.first_page + good) * page, (entry.first_page + n) * page
                    self._request_kv(r, start, end, fallback=True)
                if entry.from_l2:
                    r.account = r.account.add(l2=good * page)
                    if r.pin is not None:
                        self.tree.unpin_host(r.pin)
                        r.pin = None
                else:
                    r.account = r.account.add(l3=good * page)
                    self.host_pool.free(entry.host_slots, r.owner)
                    r.prefetch_slots = []
                r.loads -= 1
                self._maybe_ready(r)
        if load.claims_device:
            self.device_pool.free(load.claims_device, ("op", load.op))
        if load.claims_host:
            self.host_pool.free(load.claims_host, ("op", load.op))
        for pin in load.pins:
            self.tree.unpin_host(pin)
        self._issue_loads()
