"""The prefill node's own cache (`runtime/prefill/prefill_cache.py`): a repeated or extended prompt
computes only its new tokens, pages the decode nodes stored in L3 are read when that is faster
than computing them, tenants never share, a faulty store costs only compute, and the KV is
always what computing it gives. Most tests drive the cache in-process with the tiny model; one
runs real node processes (a fresh prefill node reads a conversation back from L3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.core.pages import namespace_seed, page_keys
from hicache.runtime.launch import start_node
from hicache.runtime.model.llama import TinyConfig, TinyModel, to_pages
from hicache.runtime.nodes import layout_for
from hicache.runtime.prefill.prefill_cache import PrefillCache, Prefilled, Speeds
from hicache.runtime.replay import Replayer
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.storage.memory_store import MemoryStore
from hicache.runtime.verify import REL_TOL, KVLedger
from hicache.scenarios.workload import WorkItem

PAGE = 16
MODEL = TinyModel(TinyConfig())
LAYOUT = layout_for(MODEL.config, PAGE)
NS_A = namespace_seed("tiny", "a")
NS_B = namespace_seed("tiny", "b")
FIXED = Speeds(read_bps=1e12, compute_tps=1.0, measure=False)  # reading always pays


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, MODEL.config.vocab, n).tolist()


def pages_of(prompt: list[int]) -> int:
    return -(-len(prompt) // PAGE)


def assert_computes_alike(prompt: list[int], got: Prefilled) -> None:
    """The pages and the last logits equal one monolithic forward (the ledger's tolerance)."""
    kv, logits = MODEL.forward(torch.tensor(prompt, dtype=torch.int64))
    want = to_pages(kv, PAGE)
    assert got.pages.shape == want.shape
    scale = float(want.abs().max())
    assert float((got.pages - want).abs().max()) <= REL_TOL * scale
    assert float((got.logits - logits).abs().max()) <= REL_TOL * float(logits.abs().max())


async def run(cache: PrefillCache, prompt: list[int], ns: int = NS_A) -> Prefilled:
    got = await cache.prefill(prompt, ns, 0, pages_of(prompt))
    cache.check()
    return got


async def stored(prompt: list[int], ns: int, store: MemoryStore | FileStore) -> int:
    """Put the prompt's full pages into `store` as a decode node would; returns the pages."""
    keys = page_keys(np.asarray(prompt, dtype=np.int64), PAGE, ns).tolist()
    kv, _ = MODEL.forward(torch.tensor(prompt, dtype=torch.int64))
    pool = PrefillCache(MODEL, LAYOUT, len(keys) + 1).l1
    pool.data[: len(keys)] = to_pages(kv, PAGE)[: len(keys)]
    assert await store.put(keys, pool, list(range(len(keys)))) == []
    return len(keys)


async def test_a_repeated_and_an_extended_prompt_compute_only_their_new_tokens() -> None:
    cache = PrefillCache(MODEL, LAYOUT, 64)
    first = tokens(1, 5 * PAGE + 7)
    cold = await run(cache, first)
    assert (cold.l1, cold.l2, cold.l3) == (0, 0, 0)
    assert_computes_alike(first, cold)
    again = await run(cache, first)
    assert again.l1 == 5 * PAGE  # whole pages, as the tree keeps them; the partial one is computed
    assert torch.equal(again.pages[:5], cold.pages[:5])  # full pages come back exactly as computed
    assert_computes_alike(first, again)
    turn2 = first + tokens(2, 3 * PAGE + 1)  # the next turn of the conversation
    hit = await run(cache, turn2)
    assert hit.l1 == 5 * PAGE
    assert cache.stats.computed == len(first) + 7 + (len(turn2) - 5 * PAGE)
    assert_computes_alike(turn2, hit)
    whole = turn2[: 8 * PAGE]  # a prompt of whole pages, every one cached
    full = await run(cache, whole)
    assert full.l1 == len(whole) - 1
    assert torch.equal(full.pages, hit.pages[:8])  # the recomputed last token wrote no tree page


async def test_another_tenants_identical_prompt_gets_nothing() -> None:
    store = MemoryStore(LAYOUT)
    cache = PrefillCache(MODEL, LAYOUT, 64, store=store, speeds=FIXED)
    prompt = tokens(3, 4 * PAGE + 3)
    await stored(prompt, NS_A, store)  # tenant A's pages are in L3 as well
    await run(cache, prompt, NS_A)
    assert (await run(cache, prompt, NS_A)).cached > 0
    other = await run(cache, prompt, NS_B)
    assert (other.l1, other.l2, other.l3) == (0, 0, 0)
    assert_computes_alike(prompt, other)
    shorter = prompt[: 4 * PAGE + 1]  # its last page reuses a slot that held A's longer one
    tail = await run(cache, shorter, NS_B)
    assert not tail.pages[-1, :, :, 1:].any()  # past the prompt: zeros, nothing of A's KV
    assert_computes_alike(shorter, tail)


@pytest.mark.parametrize("above", [True, False])
async def test_l3_is_read_only_when_reading_beats_computing(above: bool) -> None:
    store = MemoryStore(LAYOUT)
    prompt = tokens(4, 6 * PAGE + 5)
    held = await stored(prompt, NS_A, store)
    tps = 1000.0
    break_even = LAYOUT.page_bytes / PAGE * tps  # bytes/s at which a page reads as fast as it computes
    speeds = Speeds(read_bps=break_even * (1.5 if above else 0.5), compute_tps=tps, measure=False)
    cache = PrefillCache(MODEL, LAYOUT, 64, store=store, speeds=speeds)
    got = await run(cache, prompt)
    if above:
        assert got.l3 == held * PAGE and cache.stats.l3_declined_pages == 0
    else:
        assert got.l3 == 0 and cache.stats.l3_declined_pages == held
    assert_computes_alike(prompt, got)


async def test_pages_read_from_l3_enter_the_tree() -> None:
    store = MemoryStore(LAYOUT)
    prompt = tokens(5, 4 * PAGE + 9)
    held = await stored(prompt, NS_A, store)
    cache = PrefillCache(MODEL, LAYOUT, 64, store=store, speeds=FIXED)
    assert (await run(cache, prompt)).l3 == held * PAGE
    assert (await run(cache, prompt)).l1 == 4 * PAGE  # now from L1


async def test_a_torn_or_failing_store_falls_back_to_computing(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "l3", LAYOUT)
    prompt = tokens(6, 5 * PAGE + 2)
    held = await stored(prompt, NS_A, store)
    keys = page_keys(np.asarray(prompt, dtype=np.int64), PAGE, NS_A).tolist()
    torn = store.path(keys[2])
    torn.write_bytes(torn.read_bytes()[:100])  # a page cut short: it reads as a miss
    cache = PrefillCache(MODEL, LAYOUT, 64, store=store, speeds=FIXED)
    got = await run(cache, prompt)
    assert got.l3 in (0, 2 * PAGE)  # `exists` may count the torn page; `get` stops before it
    assert_computes_alike(prompt, got)
    assert held == 5

    class Failing(MemoryStore):
        async def get(self, *args, **kw) -> int:  # type: ignore[override]
            raise OSError("the disk went away")

    failing = Failing(LAYOUT)
    await stored(prompt, NS_A, failing)
    cache = PrefillCache(MODEL, LAYOUT, 64, store=failing, speeds=FIXED)
    got = await run(cache, prompt)
    assert got.cached == 0 and cache.stats.l3_short_reads == 1
    assert_computes_alike(prompt, got)


async def test_pages_evicted_from_l1_come_back_from_l2() -> None:
    cache = PrefillCache(MODEL, LAYOUT, 9, l2_pages=16)
    a, b = tokens(9, 4 * PAGE + 3), tokens(10, 4 * PAGE + 3)
    cold = await run(cache, a)
    await run(cache, b)
    await run(cache, tokens(11, 4 * PAGE + 3))  # L1 holds two prompts: `a` goes to L2
    back = await run(cache, a)
    assert back.l2 == 4 * PAGE and back.l1 == 0  # its partial page went with L1's room
    assert torch.equal(back.pages[:4], cold.pages[:4])
    assert_computes_alike(a, back)


def test_the_speed_estimates_follow_what_is_measured_unless_fixed() -> None:
    speeds = Speeds(read_bps=1e9, compute_tps=1e3)
    speeds.saw_read(10**6, 1e-2)  # 1e8 B/s measured
    speeds.saw_compute(1000, 0.1)  # 1e4 tokens/s measured
    assert 1e8 < speeds.read_bps < 1e9 and 1e3 < speeds.compute_tps < 1e4
    before = speeds.compute_tps
    speeds.saw_compute(1, 1.0)  # one token measures overhead, not a rate: ignored
    assert speeds.compute_tps == before
    fixed = Speeds(read_bps=1e9, compute_tps=1e3, measure=False)
    fixed.saw_read(10**6, 1e-2)
    fixed.saw_compute(1000, 0.1)
    assert (fixed.read_bps, fixed.compute_tps) == (1e9, 1e3)
    with pytest.raises(ValueError, match="read_bps"):
        Speeds(read_bps=0)


async def test_a_prompt_larger_than_l1_is_computed_without_the_cache() -> None:
    cache = PrefillCache(MODEL, LAYOUT, 4)
    prompt = tokens(7, 6 * PAGE)
    got = await run(cache, prompt)
    assert got.cached == 0 and cache.stats.uncached == 1
    assert_computes_alike(prompt, got)


@pytest.mark.slow
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from([NS_A, NS_B]), st.integers(0, 3), st.integers(1, 5 * PAGE)),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from([0, 6]),
)
def test_tree_invariants_hold_under_random_prompts_and_evictions(
    requests: list[tuple[int, int, int]], l2_pages: int
) -> None:
    """Prompts share prefixes (a few stems), cross tenants and overflow a small L1 (evictions),
    some at once: after each, no slot is leaked or held twice (`check`) and locked pages were
    never evicted under a prompt using them (its KV is still what computing gives)."""
    stems = [tokens(100 + i, 5 * PAGE) for i in range(4)]

    async def main() -> None:
        cache = PrefillCache(MODEL, LAYOUT, 12, l2_pages=l2_pages)
        results: list[tuple[list[int], Prefilled]] = []

        async def one(ns: int, stem: int, n: int) -> None:
            prompt = stems[stem][:n]
            results.append((prompt, await cache.prefill(prompt, ns, 0, pages_of(prompt))))

        async with trio.open_nursery() as nursery:
            for req in requests:
                nursery.start_soon(one, *req)
        cache.check()
        assert not cache.tree.live_locks and not cache.tree.live_pins
        for prompt, got in results:
            assert_computes_alike(prompt, got)

    trio.run(main)


@pytest.mark.process
async def test_a_fresh_prefill_node_reads_a_conversation_back_from_l3(tmp_path: Path) -> None:
    """Real processes. A conversation's second turn hits the prefill node's own cache; after
    both nodes stop, a fresh prefill node on the same L3 (and a decode node with an empty one)
    reads the first turns' prompt and answer from the pages the decode node stored."""
    logs, l3 = tmp_path / "logs", tmp_path / "l3"
    ledger = KVLedger(MODEL, PAGE)
    prompt = np.asarray(tokens(8, 70 + 8 + 40 + 8 + 30), dtype=np.int64)
    items = [
        WorkItem("t0", 0.0, 70, 8, session="s", turn=0, prompt=prompt[:70]),
        WorkItem("t1", 0.0, 118, 8, session="s", turn=1, prompt=prompt[:118]),
        WorkItem("t2", 0.0, 156, 8, session="s", turn=2, prompt=prompt),
    ]

    async def nodes(prefill_args: list[str], storage: Path) -> tuple:
        prefill = await start_node(
            ["prefill", "--engine", "tcp", "--page-size", str(PAGE), *prefill_args], logs, "p"
        )
        args = [
            "decode",
            "--engine",
            "tcp",
            "--prefill",
            f"127.0.0.1:{prefill.port}",
            "--page-size",
            str(PAGE),
        ]
        args += ["--l1-pages", "64", "--l2-pages", "64", "--storage-dir", str(storage)]
        return prefill, await start_node(args, logs, "d")

    prefill, decode = await nodes([], l3)
    try:
        replayer = Replayer("127.0.0.1", decode.port, ledger, token_bytes=LAYOUT.token_bytes)
        with trio.fail_after(120):
            result = await replayer.run(items[:2], sequential=True, time_scale=0.0)
        assert result.problems == []
        cold, second = result.records
        assert cold.prefill_cached_tokens == 0
        assert second.prefill_cached_tokens == cold.prompt_tokens // PAGE * PAGE  # its first prompt
    finally:
        decode.stop()
        prefill.stop()
    fast = ["--storage-dir", str(l3), "--fixed-speeds", "--l3-read-bytes-per-s", "1e12"]
    prefill, decode = await nodes(fast, tmp_path / "l3-fresh")
    try:
        replayer.port = decode.port
        with trio.fail_after(120):
            result = await replayer.run(items[2:], sequential=True, time_scale=0.0)
        assert result.problems == []  # the KV read from L3 is what computing gives
        (third,) = result.records[2:]
        # The decode node stored the second turn's prompt and answer: all their full pages.
        assert third.prefill_cached_tokens >= (118 + 8 - 1) // PAGE * PAGE
    finally:
        decode.stop()
        prefill.stop()
