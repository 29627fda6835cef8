"""The simulator's and the runtime's prefill nodes decide alike: fed the same prompts, one at a
time, they count the same cached tokens for each and end with the same pages on L1 and on L2
(both run the core's prefill planner; the runtime computes in one more L1 page than it caches,
so its L1 is one page larger)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from hicache.core.pages import namespace_seed, page_keys
from hicache.core.tree import TieredRadixTree
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.prefill.prefill_cache import WORK_PAGES, PrefillCache, Speeds
from hicache.sim.channel import Channel
from hicache.sim.costs import NodeCosts
from hicache.sim.engine import EventLoop
from hicache.sim.geometry import model_preset
from hicache.sim.hardware import gpu_preset
from hicache.sim.prefill import PrefillJob, PrefillNode

PAGE = 4
MODEL = TinyModel(TinyConfig())
LAYOUT = layout_for(MODEL.config, PAGE)
NS = namespace_seed("tiny", "agree")
GAP = 1000.0  # seconds between simulated arrivals: each prompt ends before the next arrives


def conversation_prompts(seed: int, count: int, max_pages: int) -> list[list[int]]:
    """Prompts that extend, branch from and repeat earlier ones, at most `max_pages` pages each."""
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    for _ in range(count):
        base: list[int] = []
        if prompts and rng.random() < 0.8:
            earlier = prompts[int(rng.integers(len(prompts)))]
            base = earlier[: int(rng.integers(0, len(earlier) + 1))]
        room = max_pages * PAGE - len(base)
        grow = int(rng.integers(1 if not base else 0, room + 1)) if room > 0 else 0
        prompt = base + rng.integers(0, MODEL.config.vocab, grow).tolist()
        prompts.append(prompt or [1])
    return prompts


def tiers(tree: TieredRadixTree) -> tuple[set[int], set[int]]:
    """The keys of the pages on L1 and on L2."""
    l1: set[int] = set()
    l2: set[int] = set()
    for node in tree.nodes():
        if node.device is not None:
            l1.update(node.keys)
        if node.host is not None:
            l2.update(node.keys)
    return l1, l2


Decisions = tuple[list[int], list[tuple[set[int], set[int]]]]  # cached tokens, tiers after each


def simulate(prompts: list[list[int]], l1: int, l2: int) -> Decisions:
    loop = EventLoop()
    costs = NodeCosts(model_preset("llama-3-8b"), gpu_preset("h100"), 1)
    node = PrefillNode(
        0, loop, costs, page_size=PAGE, host=Channel("host", 5e10, 1e-5), store=None, cache_pages=(l1, l2)
    )
    tree = node.tree
    assert tree is not None
    jobs = []
    after: list[tuple[set[int], set[int]]] = []

    def arrive(job: PrefillJob) -> None:
        node.submit(job)
        node.when_done(job.rid, lambda: after.append(tiers(tree)))  # its pages are in by then

    for i, prompt in enumerate(prompts):
        keys = page_keys(np.asarray(prompt, dtype=np.int64), PAGE, NS).tolist()
        job = PrefillJob(f"r{i}", len(prompt), keys, arrival=i * GAP)
        jobs.append(job)
        loop.call_at(job.arrival, arrive, job)
    loop.run()
    assert all(job.done_at >= 0 and job.done_at < job.arrival + GAP for job in jobs)
    return [job.cached_tokens for job in jobs], after


async def serve(prompts: list[list[int]], l1: int, l2: int) -> Decisions:
    cache = PrefillCache(MODEL, LAYOUT, l1, l2_pages=l2, speeds=Speeds(measure=False))
    cached = []
    after = []
    for prompt in prompts:
        got = await cache.prefill(prompt, NS, 0, -(-len(prompt) // PAGE))
        cache.check()
        cached.append(got.cached)
        after.append(tiers(cache.tree))
    assert cache.stats.uncached == 0
    if l2:
        assert cache.stats.l2 > 0  # some pages came back from L2
    return cached, after


@pytest.mark.parametrize(("seed", "l1", "l2"), [(0, 6, 0), (1, 8, 12), (4, 6, 16), (5, 5, 8), (7, 4, 12)])
def test_both_prefill_nodes_make_the_same_decisions(seed: int, l1: int, l2: int) -> None:
    prompts = conversation_prompts(seed, 30, max_pages=l1 - WORK_PAGES)
    sim_cached, sim_tiers = simulate(prompts, l1, l2)
    run_cached, run_tiers = trio.run(serve, prompts, l1 + WORK_PAGES, l2)
    assert run_cached == sim_cached
    assert run_tiers == sim_tiers
    assert sum(sim_cached) > 0  # the prompts did share pages: something was decided
