"""The decode batch: the requests the core handed to decoding (`StartDecode`, growing by
`ExtendKV`, paused by `Retract`, answered by `Respond`), stepped with one batched forward for
all of them, the model's attention reading K/V straight from their L1 pages.

Each new token's K/V lands in a scratch page first (past the core's pages) and is copied into the
request's page once the core granted it, so a step never writes a page the core owns. Finished
sequences go back to the core (`Finished`), which inserts them into the tree and backs them up.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import attrs
import torch
import trio

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.runtime.decode.feed import Feed
from hicache.runtime.decode.live import Live, LiveTable
from hicache.runtime.kv.kv_digest import page_digest
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.model.llama import TinyModel, from_pages
from hicache.runtime.model.sampling import TokenLogprob, choose
from hicache.runtime.wire.sampling_fields import Sampling

# Runs one step's forward (given as a function of no arguments) off the event loop.
Forward = Callable[[Callable[[], list[int]]], Awaitable[list[int]]]


@attrs.define
class _Step:
    """One batched decode step: per request, its page table (the current page replaced by a
    scratch page), the partial page to copy into the scratch page first, the position and
    token, and how to draw the next token."""

    tables: list[list[int]] = attrs.Factory(list)
    copies: list[tuple[int, int, int] | None] = attrs.Factory(list)  # (page, scratch, positions)
    positions: list[int] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)
    sampling: list[Sampling] = attrs.Factory(list)
    prompts: list[list[int]] = attrs.Factory(list)  # what the penalties read (empty: none asked)
    outputs: list[list[int]] = attrs.Factory(list)
    logprobs: list[TokenLogprob | None] = attrs.Factory(list)  # filled by the forward


class Batch:
    """Executes the batch commands on `live`'s requests and steps the running ones; `answered`
    is told of each request the core responded to."""

    def __init__(
        self,
        feed: Feed,
        live: LiveTable,
        l1: KVPool,
        model: TinyModel,
        *,
        page_size: int,
        scratch: list[int],
        answered: Callable[[Live], None],
    ) -> None:
        self.feed, self.live, self.l1, self.model = feed, live, l1, model
        self.page = page_size
        self.scratch = scratch  # L1 pages past the core's, one per request of a forward
        self.answered = answered
        self._wake = trio.Event()
        self._compute = trio.CapacityLimiter(1)

    # ------------------------------------------------------------------ the core's commands

    def start(self, c: cmd.StartDecode) -> None:
        live = self.live[c.req]
        live.kv_len = c.prompt_len
        live.slots = list(c.device_slots)
        live.account = c.account.as_dict()
        if live.first_token_at < 0:
            live.first_token_at = c.ready_at  # its KV was complete then; the batch may have been full
            live.promised = c.promised  # what its first admission restored locally
            page = self.page
            keys = live.page_keys(page, c.prompt_len // page)  # the keys the core gave its pages
            # Digests read every byte of the request's KV: only a client that asked for proof
            # (`verify`, as `hicache run --runtime` does) pays for them; serving does not.
            pages = self.l1.data[torch.tensor(c.device_slots, dtype=torch.int64)] if live.verify else None
            live.start_pages = [
                {
                    "key": keys[i] if i < len(keys) else None,
                    "digest": page_digest(pages[i]) if pages is not None else None,
                    "source": "prefill" if i in live.received else "cache",
                    "sent": live.received.get(i),
                }
                for i in range(math.ceil(live.kv_len / page))
            ]
            if pages is not None:
                live.start_kv = (
                    from_pages(pages.cpu(), live.kv_len).contiguous().view(torch.uint8).numpy().tobytes()
                )
        live.received = {}
        live.running = True
        self._wake.set()

    def extend(self, c: cmd.ExtendKV) -> None:
        live = self.live[c.req]
        del live.slots[c.first_page :]
        live.slots.extend(c.device_slots)

    def retract(self, c: cmd.Retract) -> None:
        live = self.live[c.req]
        live.running = False
        live.slots = []

    def respond(self, c: cmd.Respond) -> None:
        live = self.live[c.req]
        live.account = c.account.as_dict()
        live.outcome, live.reason = str(c.outcome), c.reason
        if c.outcome == "finished" and live.kv_len and live.verify:
            full = live.slots[: live.kv_len // self.page]  # the tree's now, unchanged yet
            live.final_pages = [page_digest(p) for p in self.l1.data[torch.tensor(full, dtype=torch.int64)]]
        live.running = False
        live.slots = []
        self.answered(live)

    # ------------------------------------------------------------------ stepping

    async def run(self) -> None:
        """A single rank's loop: one step for every running request, computed off the loop."""
        while True:
            batch = [x for x in self.live.values() if x.running]
            if not batch:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            await self.step(batch, self.feed.now(), self._in_thread)

    async def step_in_order(self, now: float, forward: Forward) -> None:
        """A TP round's step: every rank steps the same batch in the same order (the model's
        all-reduces pair up), and feeds the same `Finished` and `Decoded` events."""
        batch = sorted((x for x in self.live.values() if x.running), key=lambda x: x.seq)
        await self.step(batch, now, forward)

    async def _in_thread(self, fn: Callable[[], list[int]]) -> list[int]:
        return await trio.to_thread.run_sync(fn, limiter=self._compute)

    async def step(self, batch: list[Live], now: float, forward: Forward) -> None:
        """End the requests of `batch` that are done, then step the rest, a forward per
        `len(scratch)` of them."""
        batch = self._finish_done(batch, now)
        for first in range(0, len(batch), len(self.scratch)):
            part = batch[first : first + len(self.scratch)]
            step = self._plan(part)
            tokens = await forward(lambda step=step: self._forward(step))
            for live, scratch, token, lp in zip(part, self.scratch, tokens, step.logprobs, strict=False):
                if live.running:
                    self._advance(live, scratch, token, lp)

    def _finish_done(self, batch: list[Live], now: float) -> list[Live]:
        """Feed `Finished` for the requests of `batch` that drew a stop token or reached
        `max_new`, in batch order; the ones still running."""
        for live in batch:
            if live.gen and live.gen[-1] in live.stop_ids:
                live.finish_reason = "stop"
            elif len(live.gen) >= live.max_new:
                live.finish_reason = "length"
            else:
                continue
            live.running = False
            self.feed.put(ev.Finished(now, live.rid))
        return [x for x in batch if x.running]

    def _plan(self, batch: list[Live]) -> _Step:
        """What one batched step reads, taken on the event loop (slots change only here).

        Each request's current page is stood in for by a scratch page of its own, which the
        step copies the page's earlier positions into and writes the new position's K/V into:
        the step never writes a page the core owns, so a request aborted meanwhile (its pages
        freed and maybe reused) loses nothing but its own result. `_advance` copies the new K/V
        into the request's page once the core has granted it."""
        page = self.page
        step = _Step()
        for live, scratch in zip(batch, self.scratch, strict=False):
            pos = live.kv_len
            full, offset = divmod(pos, page)
            step.copies.append((live.slots[full], scratch, offset) if offset else None)
            step.tables.append([*live.slots[:full], scratch])
            step.positions.append(pos)
            step.tokens.append(live.tokens[pos])
            step.sampling.append(live.sampling)
            penalized = live.sampling.penalized  # a copy: the step's thread reads it
            step.prompts.append(live.prompt if penalized else [])
            step.outputs.append(list(live.gen) if penalized else [])
        return step

    def _forward(self, step: _Step) -> list[int]:
        """One forward for the whole batch (in a worker thread), and the next token of each (their
        log-probabilities, where asked for, land in `step.logprobs`)."""
        data = self.l1.data
        for copy in step.copies:
            if copy is not None:
                src, dst, offset = copy
                data[dst, :, :, :offset] = data[src, :, :, :offset]
        logits = self.model.decode_batch(data, step.tables, step.positions, step.tokens)
        positions = [p + 1 for p in step.positions]  # every row seeded
        tokens, step.logprobs = choose(logits, step.sampling, positions, step.prompts, step.outputs)
        return tokens

    def _advance(self, live: Live, scratch: int, token: int, lp: TokenLogprob | None) -> None:
        """The step's token KV exists: tell the core (it grants the page), then copy it there."""
        page = self.page
        pos = live.kv_len
        new_keys: list[int] = []
        if (pos + 1) % page == 0:  # a page filled: its key chains on the one before
            new_keys = [live.page_key(page, pos // page)]
        self.feed.put(ev.Decoded(self.feed.now(), live.rid, 1, new_keys))
        if not live.running:
            # Retracted by its own growth: this step's KV got no page, but its token stands; on
            # resume the token at `pos` is part of the prompt whose KV prefill or the cache gives.
            live.add_token(token, lp)
            return
        slot = live.slots[pos // page]  # granted by an ExtendKV while the core took the Decoded
        self.l1.data[slot, :, :, pos % page] = self.l1.data[scratch, :, :, pos % page]
        live.kv_len = pos + 1
        live.add_token(token, lp)
