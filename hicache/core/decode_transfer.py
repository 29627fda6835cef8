"""The transfer track: KV from prefill (`RequestKV`) for what the node promised not to restore,
and for what a restore fell short of (`fallback`). A failed transfer is retried on the same
slots, at once or after a backoff (`TRANSFER_RETRY` timer), unless its failure is deterministic
(`KVFailed.retry` False: prefill refused it as it is); one that fails after its retries, is
refused, or is abandoned, fails the request."""

from __future__ import annotations

import math

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.backoff import retry_delay
from hicache.core.commands import Outcome, TimerKind
from hicache.core.decode_finish import DecodeFinish
from hicache.core.decode_ops import TransferOp
from hicache.core.errors import CoreError
from hicache.core.lifecycles import TransferPhase
from hicache.core.request import Request
from hicache.core.states import Decision


class DecodeTransfer(DecodeFinish):
    """Promise, request and retry transfers from prefill; account what arrived."""

    def _promise(self, r: Request, pages: int) -> None:
        r.promised_pages = pages
        self._request_kv(r, pages * self.cfg.page_size, r.prompt_len, fallback=False)

    def _request_kv(self, r: Request, start: int, end: int, *, fallback: bool, attempt: int = 0) -> None:
        t = self._new_transfer(r, start, end, fallback, attempt, TransferPhase.ACTIVE)
        if fallback and attempt == 0:
            r.account = r.account.add(fallback=end - start)
            self.stats.fallback_tokens += end - start
        self._send(r, t)

    def _new_transfer(
        self, r: Request, start: int, end: int, fallback: bool, attempt: int, phase: TransferPhase
    ) -> TransferOp:
        """A transfer of tokens [start, end) of `r` into its own slots, which it waits on."""
        page = self.cfg.page_size
        tid = next(self._ids)
        dst = r.slots[start // page : math.ceil(end / page)]
        t = TransferOp(tid, r.id, start, end, dst, attempt, fallback, phase)
        self._transfers[tid] = t
        r.transfers.add(tid)
        return t

    def _send(self, r: Request, t: TransferOp) -> None:
        self._emit(
            cmd.RequestKV(t.tid, r.id, t.start, t.end, tuple(t.dst), r.prompt_len, t.fallback, t.attempt)
        )

    def _transfer(self, e: ev.KVArrived | ev.KVFailed | ev.KVAbandoned) -> TransferOp:
        t = self._transfers.get(e.transfer)
        if t is None or t.req != e.req:
            raise CoreError(
                f"{type(e).__name__}: no transfer #{e.transfer} for request {e.req!r} is in flight"
            )
        return t

    def _on_kv_arrived(self, e: ev.KVArrived) -> None:
        r = self._req(e.req, e)
        t = self._transfer(e)
        phase = t.next_phase(ev.KVArrived)
        self._move(r, ev.KVArrived)
        was, t.phase = t.phase, phase
        del self._transfers[t.tid]
        if was is not TransferPhase.ACTIVE:  # orphaned or abandoned: the request ended already
            if t.claims:
                self.device_pool.free(t.claims, ("xfer", t.tid))
            return
        r.transfers.discard(t.tid)
        r.account = r.account.add(transferred=t.end - t.start)
        self._maybe_ready(r)

    def _on_kv_failed(self, e: ev.KVFailed) -> None:
        r = self._req(e.req, e)
        t = self._transfer(e)
        phase = t.next_phase(ev.KVFailed)
        if t.phase is not TransferPhase.ACTIVE:
            self._move(r, ev.KVFailed)  # late: the request ended already
            t.phase = phase
            del self._transfers[t.tid]
            if t.claims:
                self.device_pool.free(t.claims, ("xfer", t.tid))
            return
        retry = e.retry is not False and t.attempt < self.cfg.transfer_retries
        self._next_state(r, ev.KVFailed if retry else Decision.TRANSFER_FAILED)
        t.phase = phase
        del self._transfers[t.tid]
        r.transfers.discard(t.tid)
        if retry:
            self._move(r, ev.KVFailed)  # QUERYING or RESTORING: retried
            self.stats.transfer_retries += 1
            attempt = t.attempt + 1
            cfg = self.cfg
            delay = retry_delay(cfg.transfer_backoff_s, cfg.transfer_backoff_max_s, r.id, attempt)
            if delay <= 0:
                self._request_kv(r, t.start, t.end, fallback=t.fallback, attempt=attempt)
                return
            # Back off: the retry waits, unsent, on the same slots until its timer fires.
            later = self._new_transfer(r, t.start, t.end, t.fallback, attempt, TransferPhase.WAITING)
            timer = next(self._ids)
            self._timers[timer] = (TimerKind.TRANSFER_RETRY, later.tid)
            self._emit(cmd.SetTimer(timer, self.now + delay, TimerKind.TRANSFER_RETRY, later.tid))
            return
        if e.retry is False:  # deterministic: it was not retried, and the reason says it all
            self._end(r, Decision.TRANSFER_FAILED, Outcome.FAILED, e.reason)
            return
        self._end(
            r,
            Decision.TRANSFER_FAILED,
            Outcome.FAILED,
            f"prefill transfer failed after {t.attempt + 1} attempts: {e.reason}",
        )

    def _on_kv_abandoned(self, e: ev.KVAbandoned) -> None:
        r = self._req(e.req, e)
        t = self._transfer(e)
        phase = t.next_phase(ev.KVAbandoned)
        if t.phase is TransferPhase.ORPHANED:  # the request ended already; the claims wait
            self._move(r, ev.KVAbandoned)
            t.phase = phase
            return
        self._next_state(r, Decision.TRANSFER_FAILED)
        t.phase = phase
        self.stats.transfers_abandoned += 1
        # No retry: a retry would write the same slots, which the abandoned transfer may still
        # overwrite. Ending the request leaves the transfer its slots until it ends.
        self._end(r, Decision.TRANSFER_FAILED, Outcome.FAILED, f"prefill transfer abandoned: {e.reason}")
