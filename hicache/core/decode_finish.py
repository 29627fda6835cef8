"""How a request ends: finished (its pages to the tree), aborted or failed, with everything it
holds given back. Slots that I/O in flight still writes or reads are claimed by that operation
until it completes; an ended request is forgotten once no I/O refers to it."""

from __future__ import annotations

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.commands import Outcome
from hicache.core.decode_batch import DecodeBatch
from hicache.core.errors import CoreError
from hicache.core.lifecycles import PrefetchPhase, Step, TransferPhase
from hicache.core.pool import Owner, SlotPool
from hicache.core.request import Request
from hicache.core.states import State, Trigger


class DecodeFinish(DecodeBatch):
    """Finish, abort and failure; release of what a request holds; forgetting it."""

    def _on_finished(self, e: ev.Finished) -> None:
        r = self._req(e.req, e)
        was = r.state
        self._move(r, ev.Finished)
        if was.terminal:
            return  # late, after an abort
        del self._running[r.id]
        self._store_in_tree(r)
        r.outcome = Outcome.FINISHED
        self.stats.finished += 1
        self._emit(cmd.Respond(r.id, Outcome.FINISHED, "", r.account))
        self._start_ready()

    def _on_abort(self, e: ev.AbortRequested) -> None:
        r = self._req(e.req, e)
        if r.state.terminal:
            self._move(r, ev.AbortRequested)
            return
        self._end(r, ev.AbortRequested, Outcome.ABORTED, e.reason)

    def _end(self, r: Request, trigger: Trigger, outcome: Outcome, reason: str) -> None:
        was = r.state
        self._move(r, trigger)
        if was is State.RUNNING:
            del self._running[r.id]
        self._release(r)
        r.outcome, r.reason = outcome, reason
        if outcome is Outcome.ABORTED:
            self.stats.aborted += 1
        else:
            self.stats.failed += 1
        self._emit(cmd.Respond(r.id, outcome, reason, r.account))
        self._start_ready()

    def _claim(self, pool: SlotPool, slots: list[int], r: Request, owner: Owner) -> list[int]:
        mine = [s for s in slots if pool.owner_of(s) == r.owner]
        if mine:
            pool.transfer(mine, r.owner, owner)
        return mine

    def _release(self, r: Request) -> None:
        """Give back everything `r` holds; slots that in-flight I/O still writes or reads stay
        claimed by that operation until it completes."""
        if r.id in self.queue:
            self.queue.remove(r.id)
        if r.id in self.retracted:
            self.retracted.remove(r.id)
        if r.id in self._ready:
            self._ready.remove(r.id)
        if r in self._to_query:
            self._to_query.remove(r)
        for tid in sorted(r.transfers):
            t = self._transfers[tid]
            t.phase = t.next_phase(Step.ORPHAN)
            if t.phase is TransferPhase.ENDED:  # a retry still backing off: never sent, dropped
                del self._transfers[tid]
                continue
            t.claims = self._claim(self.device_pool, t.dst, r, ("xfer", tid))
        r.transfers = set()
        kept = []
        for entry in self._load_queue:
            if entry.req != r.id:
                kept.append(entry)
            elif not entry.from_l2:
                self.host_pool.free(entry.host_slots, r.owner)
        self._load_queue = kept
        for load in self._loads.values():
            for entry in load.entries:
                if entry.req != r.id or entry.orphaned:
                    continue
                entry.orphaned = True
                load.claims_device += self._claim(self.device_pool, entry.device_slots, r, ("op", load.op))
                if not entry.from_l2:
                    load.claims_host += self._claim(self.host_pool, entry.host_slots, r, ("op", load.op))
                elif r.pin is not None:
                    load.pins.append(r.pin)
                    r.pin = None
        p = self._prefetches.get(r.prefetch_op) if r.prefetch_op is not None else None
        if p is not None:
            if p.phase in (PrefetchPhase.OPEN, PrefetchPhase.OPEN_DONE):
                p.claims += self._claim(self.host_pool, p.slots, r, ("op", p.op))
                # Cancel even if this rank's copy ended: that is rank-local, and a driver
                # ignores a cancel that reaches a prefetch which has ended.
                self._emit(cmd.CancelPrefetch(p.op))
            p.move(Step.ORPHAN)
            p.req = ""
        own = [s for s in r.slots[r.shared :] if self.device_pool.owner_of(s) == r.owner]
        if own:
            self.device_pool.free(own, r.owner)
        host = [s for s in r.prefetch_slots if self.host_pool.owner_of(s) == r.owner]
        if host:
            self.host_pool.free(host, r.owner)
        r.slots, r.prefetch_slots = [], []
        r.prefetch_open = False
        r.loads = 0
        if r.lock is not None:
            self.tree.unlock(r.lock)
            r.lock = None
        if r.pin is not None:
            self.tree.unpin_host(r.pin)
            r.pin = None
        self.reserved -= r.reserve
        r.reserve = 0

    def _on_forget(self, e: ev.ForgetRequested) -> None:
        r = self._req(e.req, e)
        if not r.state.terminal:
            raise CoreError(f"ForgetRequested: request {e.req!r} has not ended ({r.state.value})")
        if e.req in self._forget:
            raise CoreError(f"ForgetRequested: request {e.req!r} is to be forgotten already")
        self._forget.add(e.req)

    def _busy(self, rid: str) -> bool:
        """Whether I/O in flight still refers to request `rid`."""
        return (
            any(rid in q.reqs for q in self._queries.values())
            or any(t.req == rid for t in self._transfers.values())
            or any(p.req == rid for p in self._prefetches.values())
            or any(e.req == rid for load in self._loads.values() for e in load.entries)
        )

    def _forget_idle(self) -> None:
        for rid in sorted(self._forget):
            if not self._busy(rid):
                self._forget.discard(rid)
                del self.requests[rid]
