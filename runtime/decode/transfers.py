"""KV increments from the prefill node: the `RequestKV` executor.

A transfer is a `kv` message on the control connection (`PrefillLink`), a WRITE into the
request's L1 pages that ends with a notification, and prefill's answer with the first token and
a digest per page. Every page received is checked against those digests (on the authenticated
control connection): a page that differs fails the transfer, which the core retries or falls
back from, and is never decoded from.

Prefill reports its progress on a transfer (chunks computed, its place in the queue), and the
wait is for silence: a transfer is given up on only when prefill said nothing of it for
`transfer_timeout` seconds, never for taking long. A transfer given up on unanswered, or whose
request ended (the client left, the request failed), is cancelled on prefill, which drops its
queued or running work. A failure prefill calls deterministic (`refused`: the request as it is
can never be served) is reported as such (`KVFailed.retry` False) and not retried.

The core learns a transfer failed only once no byte of it can still land (a fence): prefill's
confirmation of a cancel; the TCP engine fences by itself; otherwise prefill's answer is the
fence. A transfer nobody can vouch for becomes `KVAbandoned`, and its task keeps asking
prefill until it confirms, then reports `KVFailed`, which frees the pages.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any

import attrs
import trio

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.runtime.decode.feed import Feed
from hicache.runtime.decode.injected import FaultHooks
from hicache.runtime.decode.live import Live, LiveTable
from hicache.runtime.decode.prefill_link import CONTROL_ERRORS, PrefillLink
from hicache.runtime.kv.kv_digest import page_digest
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.transfer.base import TransferEngine
from hicache.runtime.wire import protocol

log = logging.getLogger("hicache.runtime.decode")

ROUNDING_S = 1e-3  # prefill's timings may exceed the exchange they are part of by this much


class Transfers:
    """Executes `RequestKV` over `link` into `l1`, feeding the outcome to `feed`."""

    def __init__(
        self,
        feed: Feed,
        live: LiveTable,
        link: PrefillLink,
        engine: TransferEngine,
        l1: KVPool,
        moved: collections.Counter[str],
        *,
        page_size: int,
        vocab: int,
        heads: list[int] | None,
        faults: FaultHooks,
        transfer_timeout: float,
        fence_timeout: float,
    ) -> None:
        """`transfer_timeout`: how long prefill may say nothing of a transfer (neither progress
        nor its answer) before it is given up on; never a bound on how long prefill takes."""
        self.feed, self.live, self.link, self.engine = feed, live, link, engine
        self.l1, self.moved = l1, moved
        self.page = page_size
        self.vocab = vocab
        self.heads = heads  # a TP rank's KV heads, which prefill sends it
        self.faults = faults
        self.transfer_timeout = transfer_timeout
        self.fence_timeout = fence_timeout
        self.abandoned = 0  # transfers given up on without a fence (their requests failed)
        self.cancels = 0  # transfers prefill confirmed it cancelled (given up on unanswered)
        self.progress_notes = 0  # progress messages heard from prefill
        self._ongoing: dict[str, dict[int, trio.CancelScope]] = {}  # request -> its transfers' waits
        self._ended: set[int] = set()  # transfers stopped because their request ended

    async def request_kv(self, c: cmd.RequestKV) -> None:
        live = self.live[c.req]
        page, link = self.page, self.link
        fault = self.faults.transfer(c.transfer)
        reason = await fault.start()
        if reason:
            self.feed.put(ev.KVFailed(self.feed.now(), c.req, c.transfer, reason))
            return
        end, dst = fault.shape(c, page)
        receive = link.expect(c.transfer)
        arrived = link.arrivals.setdefault(c.transfer, trio.Event())
        msg = {
            "op": "kv",
            "tid": c.transfer,
            **({"heads": self.heads} if self.heads is not None else {}),
            "tokens": live.tokens[: c.prompt_len],  # the prompt of this admission
            "namespace": live.seed,  # prefill reuses work only within one tenant's namespace
            "sampling": self._sampling(live),  # prefill draws the first token as decode draws the rest
            "start": c.start,
            "end": end,
            "dst": dst,
            "progress": True,  # prefill tells how it goes: the wait below is for silence
        }
        reply: dict[str, Any] = {}
        silence = self.transfer_timeout
        # The deadline is for silence: every word from prefill about this transfer moves it on.
        scope = trio.CancelScope(deadline=trio.current_time() + silence)

        def heard(note: dict[str, Any]) -> None:
            self.progress_notes += 1
            scope.deadline = trio.current_time() + silence

        link.follow(c.transfer, heard)
        ongoing = self._ongoing.setdefault(c.req, {})
        ongoing[c.transfer] = scope
        with scope:
            try:
                sent_at = self.feed.now()
                gen = await link.send(c.transfer, msg)
                reply = await receive.receive()
                if reply.get("ok"):
                    await arrived.wait()
                reason = await fault.answered(lambda: link.cut(gen))
            except CONTROL_ERRORS as exc:
                reason = f"prefill connection lost: {exc or type(exc).__name__}"
        ongoing.pop(c.transfer, None)
        if not ongoing:
            self._ongoing.pop(c.req, None)
        link.forget(c.transfer)
        link.arrivals.pop(c.transfer, None)
        retry = True
        if c.transfer in self._ended:
            self._ended.discard(c.transfer)
            reason = "its request ended"
        elif scope.cancelled_caught:
            reason = f"prefill said nothing of it for {silence:g} s"
        elif not reason and not reply.get("ok"):
            reason = str(reply.get("reason", "prefill failed"))
            retry = reply.get("refused") is not True  # refused as it is: asking again fails again
            live.refused = live.refused or not retry
        elif not reason and end < c.end:
            reason = f"prefill sent {len(dst)} of {len(c.dst_slots)} pages (injected)"
        if not reason and reply.get("ok"):
            reason = self._bad_reply(reply, len(dst)) or self._bad_scores(reply, live)
            if reason:
                log.warning("transfer %d failed: %s", c.transfer, reason)
        if not reason:  # always: a page that is not what prefill sent is never served
            fault.received(self.l1, dst)
            # Hashing the pages reads all their bytes: a worker thread does it, off the loop.
            got = await trio.to_thread.run_sync(self._digests, dst)
            reason = self._check_received(got, reply["digests"], c.start // page)
        if reason and not arrived.is_set() and not await self._fence(c.transfer, answered=bool(reply)):
            # Its bytes may still land: the request fails and its pages stay with the transfer.
            self.abandoned += 1
            self.feed.put(ev.KVAbandoned(self.feed.now(), c.req, c.transfer, f"{reason}; not fenced"))
            link.arrivals[c.transfer] = arrived
            await self._settle_abandoned(c.transfer, c.req, arrived)
            return
        if reason:
            self.feed.put(ev.KVFailed(self.feed.now(), c.req, c.transfer, reason, retry))
            return
        self.moved["transfer_bytes"] += len(dst) * self.l1.layout.page_bytes
        if live.prefill_cached is None:  # the request's first prefill, not a fallback's
            live.prefill_cached = _cached_tokens(reply.get("cached"))
            live.phases = _phases(reply.get("timing"), sent_at - live.arrival, self.feed.now() - sent_at)
        for j, digest in enumerate(reply["digests"]):
            live.received[c.start // page + j] = digest
        if not live.gen:
            live.add_token(int(reply["first_token"]), reply.get("first_logprob"))
        if self._scores_wanted(live):
            live.prompt_logprobs = reply["prompt_logprobs"]  # checked by `_bad_scores`
        self.feed.put(ev.KVArrived(self.feed.now(), c.req, c.transfer))

    def request_ended(self, req: str) -> None:
        """Request `req` ended (answered, failed or aborted): stop waiting for its transfers,
        which are then cancelled on prefill too, so prefill drops their queued or running work."""
        for tid, scope in self._ongoing.pop(req, {}).items():
            self._ended.add(tid)
            scope.cancel()

    async def _fence(self, tid: int, *, answered: bool) -> bool:
        """Make sure no more bytes of transfer `tid` land in L1; False if that cannot be shown.

        Unanswered, the transfer may still be queued or computing on prefill: prefill is asked
        to cancel it (dropping that work) and confirm, which fences it. Otherwise the engine
        fences by itself where it reads every byte (TCP), or prefill's answer is the fence,
        since it answers only once its WRITE settled."""
        if not answered and await self.link.cancel(tid, self.fence_timeout):
            self.cancels += 1
            return True
        if await self.engine.fence(f"kv:{tid}".encode()):
            return True
        return answered

    async def _settle_abandoned(self, tid: int, req: str, arrived: trio.Event) -> None:
        """Keep asking prefill to settle an abandoned transfer; its pages are freed once it has
        (or once its notification shows the WRITE completed)."""
        wait = self.fence_timeout
        while not arrived.is_set():
            if await self.link.cancel(tid, self.fence_timeout):
                break
            with trio.move_on_after(wait):
                await arrived.wait()
            wait = min(wait * 2, 60.0)
        self.link.arrivals.pop(tid, None)
        self.feed.put(ev.KVFailed(self.feed.now(), req, tid, "abandoned transfer settled"))

    def _bad_reply(self, reply: dict[str, Any], pages: int) -> str:
        """Why prefill's `ok` answer cannot be used ("" if it can): a peer's fields are checked
        like a client's, and a bad one fails the transfer instead of the node."""
        digests = reply.get("digests")
        if not (
            isinstance(digests, list) and len(digests) == pages and all(isinstance(d, str) for d in digests)
        ):
            got = protocol.show(digests)
            return f"prefill's answer: field 'digests' must be a list of {pages} strings, got {got}"
        token = reply.get("first_token")
        if type(token) is not int or not 0 <= token < self.vocab:
            return f"prefill's answer: field 'first_token' must be a token id, got {protocol.show(token)}"
        lp = reply.get("first_logprob")
        if lp is not None and not is_token_logprob(lp, self.vocab):
            return (
                "prefill's answer: field 'first_logprob' must be [logprob, [[token id, logprob], ...]], "
                f"got {protocol.show(lp)}"
            )
        return ""

    def _scores_wanted(self, live: Live) -> bool:
        """Whether this transfer asks prefill for the prompt's log-probabilities: until one
        answer has brought them (a re-admission's prompt holds output tokens too), and under TP
        only from the rank that answers the client (the first heads')."""
        if live.sampling.prompt_logprobs_from < 0 or live.prompt_logprobs is not None:
            return False
        return self.heads is None or self.heads[0] == 0

    def _sampling(self, live: Live) -> dict[str, Any]:
        """The `sampling` field of the request's `kv` message."""
        if live.sampling.prompt_logprobs_from >= 0 and not self._scores_wanted(live):
            return attrs.evolve(live.sampling, prompt_logprobs_from=-1).to_wire()
        return live.sampling.to_wire()

    def _bad_scores(self, reply: dict[str, Any], live: Live) -> str:
        """Why the prompt's log-probabilities in prefill's answer cannot be used ("" if they can,
        or if this answer owes none)."""
        if not self._scores_wanted(live):
            return ""
        want = len(live.prompt) - live.sampling.prompt_logprobs_from
        lps = reply.get("prompt_logprobs")
        if not (
            isinstance(lps, list)
            and len(lps) == want
            and lps[0] is None
            and all(is_token_logprob(lp, self.vocab) for lp in lps[1:])
        ):
            return (
                f"prefill's answer: field 'prompt_logprobs' must be a list of {want}: None, then "
                f"[logprob, [[token id, logprob], ...]] each; got {protocol.show(lps)}"
            )
        return ""

    def _digests(self, dst: list[int]) -> list[str]:
        return [page_digest(self.l1.data[d]) for d in dst]

    def _check_received(self, got: list[str], digests: list[str], first: int) -> str:
        """Why the pages a transfer wrote (digests `got`) are not what prefill says it sent ("" if
        they are)."""
        for j, digest in enumerate(digests):
            if got[j] != digest:
                self.faults.rejected()
                return f"received page {first + j} differs from what prefill sent"
        return ""


def _cached_tokens(value: object) -> dict[str, int]:
    """A `kv` reply's `cached` field (tokens per prefill tier) as far as it makes sense."""
    if not isinstance(value, dict):
        return {}
    return {
        k: v
        for k, v in value.items()
        if k in ("l1", "l2", "l3") and isinstance(v, int) and not isinstance(v, bool) and v >= 0
    }


def _phases(timing: object, before: float, exchange: float) -> dict[str, float]:
    """A request's time up to its KV, in parts (seconds): `decode_wait_s` on this node before
    its KV was asked for, and of the exchange with prefill (`exchange`), prefill's own account
    (`prefill_wait_s` queued or behind other prompts' chunks, `prefill_compute_s` its forwards)
    and the rest, `transfer_s`. Prefill's figures are a peer's: used only where they are
    non-negative numbers that fit in the exchange; otherwise the exchange is all transfer."""
    out = {"decode_wait_s": round(max(0.0, before), 6)}
    parts = {}
    if isinstance(timing, dict):
        for key, name in (("wait_s", "prefill_wait_s"), ("compute_s", "prefill_compute_s")):
            if (v := protocol.seconds(timing.get(key))) is not None:
                parts[name] = v
    if len(parts) == 2 and sum(parts.values()) <= exchange + ROUNDING_S:
        out.update({k: round(v, 6) for k, v in parts.items()})
        exchange -= sum(parts.values())
    out["transfer_s"] = round(max(0.0, exchange), 6)
    return out


def is_token_logprob(value: object, vocab: int) -> bool:
    """Whether `value` is a token's log-probabilities as the nodes send them:
    [logprob, [[token id, logprob], ...]], each logprob a finite number (at most 0)."""

    def number(x: object) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and -math.inf < x <= 1e-9

    if not (isinstance(value, list) and len(value) == 2 and number(value[0]) and isinstance(value[1], list)):
        return False
    return all(
        isinstance(p, list) and len(p) == 2 and type(p[0]) is int and 0 <= p[0] < vocab and number(p[1])
        for p in value[1]
    )
