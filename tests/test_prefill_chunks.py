"""The prefill node's scheduler at work between real nodes (in one process, the TCP engine, the
tiny model): a long prompt computed in chunks while short ones pass it, cancellation reaching
queued and running prompts, deterministic refusals answered once, and KV that is still exact."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
from node_pair import GUARD_S, node_pair

from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.wire.client import DecodeClient

pytestmark = pytest.mark.slow  # a few seconds each: nodes computing a 7,000-token prompt

LONG = 7000  # tokens of the long prompt
SMALL = 40
CHUNK, STEP = 256, 512  # the prefill node's --chunked-prefill-size and --max-prefill-tokens here
BIG = {"l1_pages": 1024, "l2_pages": 1024}  # the decode node holds a 7,000-token prompt


class Paced(TinyModel):
    """The tiny model, taking `delay` seconds more for each chunk of a prompt longer than
    `over` tokens (so short prompts arrive while a long one is in progress), and holding a
    long prompt's chunk while `hold` is clear."""

    def __init__(self, delay: float = 0.1, over: int = 1000) -> None:
        super().__init__(TinyConfig())
        self.delay, self.over = delay, over
        self.hold = threading.Event()
        self.hold.set()

    def prefill_into(
        self,
        pool: torch.Tensor,
        page_table: Sequence[int],
        start: int,
        tokens: Sequence[int] | torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        if len(page_table) * 16 > self.over:
            assert self.hold.wait(GUARD_S * 3), "the test never let the chunk go"
            time.sleep(self.delay)
        return super().prefill_into(pool, page_table, start, tokens, on_layer)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


async def until(check: Callable[[], Any], what: str) -> None:
    with trio.fail_after(GUARD_S * 3):
        while not check():
            await trio.sleep(0.01)


async def test_short_prompts_pass_a_long_one_computed_in_chunks(tmp_path: Path) -> None:
    """A 7,000-token prompt and short prompts arriving one after another while it computes:
    every one finishes with exact KV, and each short one is computed beside at most one chunk of
    the long one. The bound, structurally: a short prompt waits for the step in progress when
    it arrives (one long chunk) and is computed in the next step (shortest remaining work
    first), beside at most one more long chunk; a step that began while it was being admitted
    adds at most one. So at most 3 long chunks, never the ~28 of the whole prompt."""
    model = Paced()
    prefill = {"staging_pages": 1024, "chunk_tokens": CHUNK, "step_tokens": STEP}
    async with node_pair(tmp_path, config=BIG, prefill=prefill, prefill_model=model) as pair:
        steps = pair.prefill.steps
        long_prompt = prompt(1, LONG)
        results: dict[str, Any] = {}

        async def one(rid: str, tokens: list[int]) -> None:
            client = await DecodeClient.connect(*pair.client.address)  # type: ignore[misc]
            try:
                with trio.fail_after(GUARD_S * 6):
                    results[rid] = (await client.generate(rid, tokens, 3, verify=True), tokens)
            finally:
                await client.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "long", long_prompt)
            await until(lambda: steps.chunks >= 2, "the long prompt's first chunks")
            for i in range(6):
                await one(f"short{i}", prompt(10 + i, SMALL))
            long_done_early = any(n == LONG for _, n, _, _ in steps.served)
        for rid, ((reply, kv), tokens) in results.items():
            assert reply["outcome"] == "finished", (rid, reply)
            assert pair.ledger.check(tokens, 3, reply, kv) == [], rid
        assert not long_done_early, "the long prompt finished before the short ones: nothing was shown"
        long_chunks = {step for step, chunks in steps.history for c in chunks if c[3] == LONG}
        assert len(long_chunks) >= LONG // CHUNK  # it was chunked
        shorts = [(arrived, last) for _, n, arrived, last in steps.served if n < LONG]
        assert len(shorts) == 6
        for arrived, last in shorts:
            beside = sum(1 for step in long_chunks if arrived <= step <= last)
            assert beside <= 3, (arrived, last, beside)
        assert pair.prefill.sched.ended == 7 and not pair.prefill.sched.jobs


async def test_a_prompt_larger_than_the_staging_pool_is_refused_once(tmp_path: Path) -> None:
    """Refused as it is, it is refused again: one answer, no retry, one plain sentence."""
    async with node_pair(tmp_path, retries=2, prefill={"staging_pages": 8}) as pair:
        with trio.fail_after(GUARD_S):
            reply, _ = await pair.client.generate("big", prompt(3, 300), 3)
        assert reply["outcome"] == "failed", reply
        assert "19 staging pages" in reply["reason"] and "--staging-pages" in reply["reason"], reply
        assert "Group" not in reply["reason"] and "attempts" not in reply["reason"], reply
        assert reply["refused"] is True  # the front door answers it 400: asking again fails again
        assert pair.prefill.sched.refused == 1  # asked once: not retried
        assert pair.service.core.stats.transfer_retries == 0
        reply, _ = await pair.client.generate("small", prompt(4, 60), 3)  # the node goes on
        assert reply["outcome"] == "finished", reply
        assert reply["refused"] is False


async def test_requests_whose_clients_leave_are_dropped_on_prefill(tmp_path: Path) -> None:
    """Two long prompts, the second queued behind the first (the staging pool holds one): their
    clients leave, and prefill drops both: the queued one before any chunk, the running one
    between chunks. Counted on the node, and no chunk of either is computed afterwards."""
    model = Paced(delay=0.05)
    model.hold.clear()
    prefill = {"staging_pages": 500, "chunk_tokens": CHUNK, "step_tokens": STEP}
    async with node_pair(tmp_path, config=BIG, prefill=prefill, prefill_model=model) as pair:
        sched, steps = pair.prefill.sched, pair.prefill.steps

        async def leave_after_a_while(rid: str, seed: int) -> None:
            client = await DecodeClient.connect(*pair.client.address)  # type: ignore[misc]
            try:
                async for _ in client.generate_stream(rid, prompt(seed, LONG), 3):
                    break
            finally:
                await client.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leave_after_a_while, "a", 5)
            await until(lambda: len(sched.jobs) == 1 and steps._computing, "the first prompt computing")
            nursery.start_soon(leave_after_a_while, "b", 6)
            await until(lambda: len(sched.queue) == 1, "the second prompt queued")
            nursery.cancel_scope.cancel()  # both clients leave
        model.hold.set()
        await until(lambda: not sched.jobs and not pair.prefill._in_flight, "prefill dropping both")
        assert sched.cancelled_waiting == 1 and sched.cancelled_running == 1
        computed = sum(1 for _, chunks in steps.history for c in chunks if c[3] == LONG)
        assert computed <= 2, computed  # the held chunk, at most one more: not the ~28
        assert not steps.served
        await trio.sleep(0.3)
        assert sum(1 for _, chunks in steps.history for c in chunks if c[3] == LONG) == computed


async def test_a_silent_prefill_is_given_up_and_its_work_dropped(tmp_path: Path) -> None:
    """Prefill stuck in a chunk says nothing: the decode node gives the transfer up after its
    silence timeout (not before: progress kept it waiting until then), cancels it on prefill,
    which drops the rest of the prompt once the chunk returns."""
    model = Paced(delay=0.0)
    prefill = {"staging_pages": 1024, "chunk_tokens": CHUNK, "step_tokens": STEP}
    async with node_pair(
        tmp_path, retries=0, transfer_timeout=1.5, config=BIG, prefill=prefill, prefill_model=model
    ) as pair:
        sched, steps = pair.prefill.sched, pair.prefill.steps

        async def hold_later() -> None:
            await until(lambda: steps.chunks >= 4, "some chunks")
            model.hold.clear()  # the next long chunk hangs: no progress from here on

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold_later)
            with trio.fail_after(GUARD_S * 3):
                reply, _ = await pair.client.generate("stuck", prompt(7, LONG), 3)
        assert reply["outcome"] == "failed", reply
        assert "said nothing of it for 1.5 s" in reply["reason"], reply
        assert pair.service.transfers.progress_notes >= 4  # it heard progress before the silence
        model.hold.set()
        await until(lambda: not sched.jobs, "prefill dropping it")
        assert sched.cancelled_running == 1
        assert not steps.served


async def test_a_retry_resumes_from_the_chunks_prefill_computed(tmp_path: Path) -> None:
    """A transfer given up on part-way (prefill went silent in a chunk) is retried: the chunks
    prefill computed before stay in its cache, so the retry computes only the rest, and the KV
    is still exact."""
    model = Paced(delay=0.0)
    prefill = {"staging_pages": 1024, "chunk_tokens": CHUNK, "step_tokens": STEP}
    async with node_pair(
        tmp_path, retries=1, transfer_timeout=1.5, config=BIG, prefill=prefill, prefill_model=model
    ) as pair:
        sched, steps = pair.prefill.sched, pair.prefill.steps

        async def stall_once() -> None:
            await until(lambda: steps.chunks >= 4, "some chunks")
            model.hold.clear()
            await until(lambda: sched.cancelled_running >= 1, "the decode node giving up")
            model.hold.set()

        tokens = prompt(8, LONG)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stall_once)
            with trio.fail_after(GUARD_S * 3):
                reply, kv = await pair.client.generate("resumed", tokens, 3, verify=True)
        assert reply["outcome"] == "finished", reply
        assert pair.ledger.check(tokens, 3, reply, kv) == []
        assert pair.service.core.stats.transfer_retries == 1
        assert pair.prefill.reused_tokens >= 4 * CHUNK  # the retry started where prefill stopped
