"""The prefill node's compute loop: the scheduler's steps (`hicache.core.prefill_sched`) carried
out on real pages, and each prompt's way through it.

A prompt (`Stepper.compute`) waits in the queue for its staging pages, opens its pages in the
prefix cache (what the cache holds is not computed), then computes in chunks that `run` hands
out a step at a time. A step's chunks run one after another in one worker thread, each
prompt's chunk its own forward (`LlamaModel.prefill_into` over its L1 pages). Why not one
batched forward over the step's chunks: the paged forward pads every request's keys to the
longest one, and beside a long prompt's chunk that padding costs more than it saves (a
512-token chunk at 6,000 tokens of context plus a 200-token prompt: 11.2-18.1 s batched
against 8.3-10.1 s one after the other, `bench/prefill_sched.py --micro`, BENCHMARKS.md).

A chunk's pages leave as soon as they are computed, in layer groups during its forward
(`layer_groups`), so a long prompt's transfer overlaps its own later chunks. After every step
each prompt hears how far it is (`notify`): computed tokens, or its place in the queue; the
node passes that on to the decode node, whose deadline is for silence, not for slowness.

A prompt that is cancelled (its decode node gave up, or its connection ended) leaves the queue,
or gets no further chunk, and a chunk of it not yet begun in the step being computed is skipped;
the full pages it did compute stay in the cache, so a retry resumes from there.

Prompts the cache cannot hold (too large for its L1, or L1 held by other running prompts) are
computed in chunks the same way into a contiguous KV tensor of their own, and sent when done.
So is a prompt that asks for its own tokens' log-probabilities (`Sampling.prompt_logprobs_from`):
every position from there on must be computed, with logits at every row, not the last alone.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable

import attrs
import numpy as np
import torch
import trio

from hicache.core.prefill_sched import Chunk, Phase, PrefillScheduler
from hicache.runtime.model.kv_pages import to_pages
from hicache.runtime.model.llama import LlamaModel
from hicache.runtime.model.sampling import Knobs, TokenLogprob, prompt_logprobs
from hicache.runtime.prefill.kv_out import KVOut
from hicache.runtime.prefill.prefill_cache import CachedWork, LayerGroups, PrefillCache, Prefilled

log = logging.getLogger("hicache.runtime.prefill")

HISTORY = 4096  # steps remembered for `history` (what each step computed)


@attrs.define(eq=False)
class Prompt:
    """One prompt being served: what it asks for and how far it is."""

    key: str
    ids: np.ndarray
    first: int  # pages [first, last) go to the decode node
    last: int
    out: KVOut | None = None
    work: CachedWork | None = None  # its pages in the prefix cache
    plain: torch.Tensor | None = None  # or its own contiguous KV (outside the cache)
    start: int = 0  # tokens its cache held
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    streamed: bool = False  # its pages leave as chunks compute them
    changed: trio.Event = attrs.Factory(trio.Event)
    # Its own tokens' log-probabilities from this position on (-1: none), with this sampling's
    # `top_logprobs`; `scores` gathers them chunk by chunk (`prompt_scores` shapes them).
    scores_from: int = -1
    sampling: Knobs | None = None
    scores: list[TokenLogprob] = attrs.Factory(list)
    # Its time on this node (trio's clock): arrival, its last chunk's end, and the seconds its
    # own forwards took; the rest of the time between the two it waited (queue, other chunks).
    arrived_at: float = -1.0
    computed_at: float = -1.0
    compute_s: float = 0.0

    def prompt_scores(self) -> list[TokenLogprob | None]:
        """SGLang's input log-probabilities: one per token from `scores_from`, the first None."""
        return [None, *self.scores]

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


Tell = Callable[[dict], Awaitable[None]]


class Stepper:
    """The scheduler, the prompts it holds, and the loop (`run`) that computes its steps."""

    def __init__(
        self,
        model: LlamaModel,
        page_size: int,
        layers: int,
        sched: PrefillScheduler,
        cache: PrefillCache | None,
        limiter: trio.CapacityLimiter,
        layer_groups: int,
    ) -> None:
        self.model, self.page, self.layers = model, page_size, layers
        self.sched = sched
        self.cache = cache
        self.limiter = limiter
        self.layer_groups = layer_groups
        self.prompts: dict[str, Prompt] = {}
        self._wake = trio.Event()
        self._computing: set[str] = set()  # prompts with a chunk in the step being computed
        self._chunk_ended = trio.Event()
        # Counters the node reports.
        self.chunks = 0  # chunks computed
        self.skipped = 0  # chunks of cancelled prompts not computed
        self.uncached = 0  # prompts computed outside the cache
        self.history: collections.deque[tuple[int, tuple[tuple[str, int, int, int], ...]]] = (
            collections.deque(maxlen=HISTORY)
        )  # (step, ((prompt, lo, hi, its length), ...))
        self.arrived_at: dict[str, int] = {}  # prompt -> steps handed out when it arrived
        # Prompts computed: (prompt, its length, steps handed out when it arrived, the step of
        # its last chunk); with `history`, what was computed while each waited.
        self.served: collections.deque[tuple[str, int, int, int]] = collections.deque(maxlen=HISTORY)

    # ----------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Hand out and compute steps until cancelled."""
        token = trio.lowlevel.current_trio_token()
        while True:
            chunks = self.sched.step()
            if not chunks:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            self._computing = {c.key for c in chunks}
            self.history.append(
                (self.sched.steps, tuple((c.key, c.lo, c.hi, len(self.prompts[c.key].ids)) for c in chunks))
            )
            try:
                await trio.to_thread.run_sync(
                    self._compute, chunks, token, limiter=self.limiter, abandon_on_cancel=False
                )
            finally:
                self._computing = set()
                self._chunk_ended.set()
                self._chunk_ended = trio.Event()
            for p in list(self.prompts.values()):  # the queued ones hear where they are
                p.notify()

    def kick(self) -> None:
        self._wake.set()

    def _compute(self, chunks: list[Chunk], token: trio.lowlevel.TrioToken) -> None:
        """The step's chunks, one forward each (on the worker thread), each reported as soon as
        it is done (a short prompt computed first goes on while the others compute). A chunk of
        a prompt cancelled meanwhile is skipped; a chunk that fails fails its prompt alone."""
        for c in chunks:
            p = self.prompts.get(c.key)
            logits, error, took = None, None, 0.0
            if p is None or self.sched.phase(c.key) is not Phase.RUNNING:
                self.skipped += 1
            else:
                began = time.perf_counter()
                try:
                    logits = self._forward(p, c)
                    self.chunks += 1
                except Exception as exc:  # this prompt fails; the others go on
                    log.exception("prefill of %s failed at [%d, %d)", c.key, c.lo, c.hi)
                    error = exc
                took = time.perf_counter() - began
            trio.from_thread.run_sync(self._chunk_done, c, logits, error, took, trio_token=token)

    def _chunk_done(
        self, c: Chunk, logits: torch.Tensor | None, error: BaseException | None, took: float = 0.0
    ) -> None:
        """Chunk `c` computed (`logits`), failed (`error`) or skipped (neither), its forward
        taking `took` seconds: in trio."""
        self._computing.discard(c.key)
        self._chunk_ended.set()
        self._chunk_ended = trio.Event()
        p = self.prompts.get(c.key)
        if p is None:
            return
        p.compute_s += took
        if error is not None:
            p.error = error
            self.sched.cancel(c.key)
        elif logits is not None:
            self.sched.computed(c)
            if c.last:
                p.logits = logits
                p.computed_at = trio.current_time()
                self.served.append((c.key, len(p.ids), self.arrived_at.get(c.key, 0), self.sched.steps))
        p.notify()

    def _forward(self, p: Prompt, c: Chunk) -> torch.Tensor:
        if p.work is not None:
            assert self.cache is not None
            return self.cache.forward_sync(p.work, c.lo, c.hi, self._hook(p, c))
        assert p.plain is not None
        past = p.plain[:, :, : c.lo] if c.lo else None
        # Rows from `scores_from` on score the token after them: their logits are all wanted.
        first = max(p.scores_from, c.lo) if p.scores_from >= 0 else c.hi
        tokens = torch.from_numpy(p.ids[c.lo : c.hi].copy())
        if first >= c.hi:
            kv, logits = self.model.forward(tokens, past)
        else:
            assert p.sampling is not None
            kv, rows = self.model.forward(tokens, past, rows_from=first - c.lo)
            scored = min(c.hi, len(p.ids) - 1) - first  # the last prompt row scores no prompt token
            p.scores += prompt_logprobs(
                rows[:scored], p.ids[first + 1 : first + 1 + scored].tolist(), p.sampling
            )
            logits = rows[-1]
        p.plain[:, :, c.lo : c.hi] = kv
        return logits

    def _hook(self, p: Prompt, c: Chunk) -> Callable[[int], None] | None:
        """Each layer group of the pages chunk `c` completes, handed to the prompt's transfer
        as prefill stores it; the prompt's last group carries the notification."""
        if not p.streamed or p.out is None or p.work is None:
            return None
        a, b = max(p.first, c.lo // self.page), min(p.last, -(-c.hi // self.page))
        if a >= b:
            return None
        out, first, work, layers = p.out, p.first, p.work, self.layers

        def deliver(lo: int, hi: int, part: torch.Tensor) -> None:
            out.stage_from_thread(a - first, b - first, lo, hi, part, c.last and hi == layers)

        groups = LayerGroups(layers, self.layer_groups, deliver)
        return groups.hook(self.cache.l1.data, work.sent_pages(a, b), work.tail(b))  # type: ignore[union-attr]

    # ----------------------------------------------------------------------------- a prompt

    async def compute(
        self, p: Prompt, namespace: int, make_out: Callable[[list[int]], KVOut], tell: Tell | None
    ) -> tuple[Prefilled, list[str]]:
        """Serve prompt `p` through the queue and the steps; returns its pages and logits, and
        the digests of the pages sent, once its transfer is done. Raises `Refused` when the
        staging pool can never hold it. Left by cancellation or an error, it is dropped from
        the scheduler (no chunk of it is computed any more), its full computed pages stay in
        the cache, and its staging pages come back once its WRITEs settled."""
        self.sched.arrive(p.key, p.last - p.first)  # Refused: the caller says so, once
        p.arrived_at = trio.current_time()
        self.prompts[p.key] = p
        self.arrived_at[p.key] = self.sched.steps
        settled = True
        try:
            self._admit()
            await self._follow(p, tell, Phase.WAITING)
            job = self.sched.jobs[p.key]
            p.out = make_out(job.slots)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.out.run)
                await self._open(p, namespace)
                self.kick()
                await self._follow(p, tell, Phase.RUNNING)
                if p.error is not None:
                    raise p.error
                if self.sched.phase(p.key) is not Phase.COMPUTED or p.logits is None:
                    raise RuntimeError("the prompt was dropped before it was computed")
                done = self._finish(p)
                p.out.close()
            return done, await p.out.digests()
        finally:
            with trio.CancelScope(shield=True):
                if self.sched.cancel(p.key):
                    log.info("prefill of %s dropped: %s", p.key, self._where(p))
                while p.key in self._computing:  # its chunk is being computed into its pages
                    await self._chunk_ended.wait()
                if p.work is not None and self.cache is not None:
                    self.cache.drop(p.work)
                if p.out is not None:
                    settled = await p.out.settle()
                if settled and p.key in self.sched.jobs:
                    self.sched.release(p.key)  # else its pages stay out of use (logged)
                del self.prompts[p.key]
                self.arrived_at.pop(p.key, None)
                self._admit()

    def _where(self, p: Prompt) -> str:
        job = self.sched.jobs.get(p.key)
        if job is None or job.end == 0:
            return "while it waited"
        return f"after {job.chunks} chunks, {job.done - p.start} of {len(p.ids) - p.start} tokens"

    def _admit(self) -> None:
        for job in self.sched.admit():
            self.prompts[job.key].notify()

    async def _follow(self, p: Prompt, tell: Tell | None, phase: Phase) -> None:
        """Wait while `p` is in `phase`, telling its decode node how it goes after each step."""
        while self.sched.phase(p.key) is phase and p.error is None:
            await p.changed.wait()
            if tell is not None and self.sched.phase(p.key) is phase:
                job = self.sched.jobs[p.key]
                await tell(
                    {
                        "done": max(job.done, p.start),
                        "total": len(p.ids),
                        "queued": self.sched.position(p.key),
                    }
                )

    async def _open(self, p: Prompt, namespace: int) -> None:
        """The prompt's pages in the cache (what it holds is not computed), or a KV of its own."""
        n = len(p.ids)
        if self.cache is not None and p.scores_from < 0:
            p.work = await self.cache.open(p.ids, namespace)
        if p.work is not None:
            p.start = p.work.start
            p.streamed = bool(self.layer_groups) and p.last > p.first
            held = min(p.last, p.start // self.page)  # cached pages before the first chunk
            if p.streamed and held > p.first:
                assert p.out is not None and self.cache is not None
                p.out.stage(0, held - p.first, 0, self.layers, self.cache.pages(p.work, p.first, held))
        else:
            self.uncached += 1
            model = self.model
            p.plain = torch.empty(model.config.kv_shape(n), dtype=model.kv_dtype, device=model.device)
        self.sched.start(p.key, p.start, n)

    def _finish(self, p: Prompt) -> Prefilled:
        """A computed prompt: what was not streamed is staged, its notification queued, and its
        pages enter the cache."""
        assert p.out is not None and p.logits is not None
        if p.work is not None:
            assert self.cache is not None
            if p.streamed and not p.out.final_queued:  # its last chunk sent none of its pages
                p.out.stage(0, 0, 0, self.layers, p.logits, final=True)
            if not p.streamed:
                p.out.stage(
                    0, p.last - p.first, 0, self.layers, self.cache.pages(p.work, p.first, p.last), final=True
                )
            done = self.cache.close(p.work, p.logits, p.first, p.last)
            return done
        assert p.plain is not None
        pages = to_pages(p.plain, self.page)[p.first : p.last]
        p.out.stage(0, p.last - p.first, 0, self.layers, pages, final=True)
        if self.cache is not None:
            self.cache.stats.uncached += 1
            self.cache.stats.computed += len(p.ids)
        return Prefilled(pages, p.logits)
