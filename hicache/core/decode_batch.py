"""The decode batch: READY requests start (`StartDecode`) while it has room, `Decoded` grows a
running request's pages (`ExtendKV`) from its reservation, free pages, eviction, and under
pressure the retraction of running requests by policy (`Retract`; a retracted request's pages
go into the tree, and it is matched again at the next tick)."""

from __future__ import annotations

import math

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import RetractPolicy
from hicache.core.decode_store_back import DecodeStoreBack
from hicache.core.errors import CoreError
from hicache.core.request import Request
from hicache.core.states import Decision, State


class DecodeBatch(DecodeStoreBack):
    """Start, grow and retract running requests."""

    def _maybe_ready(self, r: Request) -> None:
        if (
            r.state is State.RESTORING
            and r.promised_pages >= 0
            and not r.prefetch_open
            and r.loads == 0
            and not r.transfers
        ):
            self._move(r, Decision.READY)
            r.ready_at = self.now
            a = r.account
            s = self.stats
            s.prompt_tokens += r.prompt_len
            s.l1_tokens += a.l1
            s.l2_tokens += a.l2
            s.l3_tokens += a.l3
            s.transferred_tokens += a.transferred
            self._ready.append(r.id)
            self._start_ready()

    def _start_ready(self) -> None:
        """Start READY requests, in order, while the decode batch has room."""
        limit = self.cfg.max_running
        while self._ready and (not limit or len(self._running) < limit):
            r = self.requests[self._ready.popleft()]
            self._move(r, Decision.START)
            self._running[r.id] = None
            page = self.cfg.page_size
            self._emit(
                cmd.StartDecode(
                    r.id,
                    tuple(r.slots),
                    r.prompt_len,
                    r.ready_at,
                    r.promised_pages * page,
                    r.account,
                )
            )

    def _on_decoded(self, e: ev.Decoded) -> None:
        r = self._req(e.req, e)
        self._next_state(r, ev.Decoded)
        if not isinstance(e.tokens, int) or isinstance(e.tokens, bool) or e.tokens < 0:
            raise CoreError(f"Decoded {e.req!r}: tokens must be an integer >= 0, got {e.tokens!r}")
        page = self.cfg.page_size
        seq = r.seq_len + e.tokens
        if len(r.keys) + len(e.new_keys) != seq // page:
            raise CoreError(
                f"Decoded {e.req!r}: {seq} tokens need {seq // page} page keys, the request has "
                f"{len(r.keys)} and the event brings {len(e.new_keys)}"
            )
        written = r.seq_len  # the KV of tokens before this step is in place
        r.decoded += e.tokens
        r.keys.extend(e.new_keys)
        had = len(r.slots)
        self._grow(r, written)
        if r.state is State.RUNNING and len(r.slots) > had:
            self._emit(cmd.ExtendKV(r.id, had, tuple(r.slots[had:])))

    def _grow(self, r: Request, written: int) -> None:
        """Give a running request the pages its tokens need: its reservation first, then free
        pages, then eviction, then retraction of running requests by policy. If `r` itself is
        retracted, only its first `written` tokens have KV (this step's never got room)."""
        need = math.ceil(r.seq_len / self.cfg.page_size)
        while len(r.slots) < need:
            if r.reserve > 0:
                r.reserve -= 1
                self.reserved -= 1
            elif self.device_pool.num_free - self.reserved < 1:
                self.tree.evict_device(1)
                self._collect_tree()
                if self.device_pool.num_free - self.reserved < 1:
                    victim = self._victim()
                    if victim is r:
                        self._retract(r, shed=0, written=written)
                        return
                    self._retract(victim, shed=need - len(r.slots), written=victim.seq_len)
                    continue
            slot = self.device_pool.alloc(1, r.owner)
            assert slot is not None
            r.slots += slot

    def _victim(self) -> Request:
        running = [self.requests[rid] for rid in self._running]
        policy = self.cfg.retract_policy
        if policy is RetractPolicy.NEWEST:
            return max(running, key=lambda x: (x.admitted_at, x.id))
        if policy is RetractPolicy.FEWEST_DECODED:
            return min(running, key=lambda x: (x.decoded, -x.admitted_at, x.id))
        return max(running, key=lambda x: (len(x.slots), x.id))

    def _retract(self, r: Request, shed: int, written: int) -> None:
        self._move(r, Decision.RETRACT)
        del self._running[r.id]
        self._store_in_tree(r, shed, written)
        r.account = r.account.add(retractions=1)
        self.stats.retracted += 1
        self.retracted.append(r.id)
        self._emit(cmd.Retract(r.id))
