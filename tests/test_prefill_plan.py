"""The prefill planner's invariants (hicache.core.prefill_plan), on random prompts that share
prefixes, random L1/L2 sizes, L3 holdings and restore costs, in both drivers' orders of calls."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.core.commands import Backup
from hicache.core.pages import page_keys
from hicache.core.prefill_plan import PrefillPlan, PrefillPlanner, attribute
from hicache.core.tree import TieredRadixTree

SETTINGS = settings(max_examples=examples(150), deadline=None)


def held_prefix(tree: TieredRadixTree, keys: Sequence[int]) -> tuple[int, int]:
    """Leading pages of `keys` on L1, and on L1 or L2, read without touching the tree."""
    node, i, l1 = tree.root, 0, 0
    while i < len(keys):
        child = node.children.get(keys[i])
        if child is None:
            break
        run = child.keys
        same = 0
        while same < len(run) and i + same < len(keys) and run[same] == keys[i + same]:
            same += 1
        if child.device is not None and l1 == i:
            l1 = i + same
        i += same
        if same < len(run):
            break
        node = child
    return l1, i


def assert_consistent(planner: PrefillPlanner) -> None:
    """The tree is sound, within both pools, and no slot is left to a finished prompt."""
    tree = planner.tree
    tree.check()
    for pool, pages in ((tree.device_pool, tree.device_pages), (tree.host_pool, tree.host_pages)):
        assert pool.num_used <= pool.capacity and pages <= pool.capacity
        assert all(pool.owner_of(s) in (None, "tree") for s in range(pool.capacity))
    assert not tree.live_locks and not tree.live_pins


prompts = st.lists(st.integers(0, 1), min_size=1, max_size=14)  # two tokens: shared prefixes
step = st.tuples(
    prompts,
    st.integers(0, 8),  # pages L3 says it holds after the tree's prefix
    st.booleans(),  # whether reading them pays
    st.booleans(),  # the prompt succeeds (its pages enter the tree) or fails
    st.integers(0, 1),  # the driver's work pages
    st.booleans(),  # the runtime's order (reserve, then restored) or the simulator's
)


@SETTINGS
@given(
    page=st.integers(1, 3),
    l1=st.integers(1, 8),
    l2=st.integers(0, 10),
    eviction=st.sampled_from(["lru", "lfu", "fifo", "mru"]),
    steps=st.lists(step, min_size=1, max_size=25),
)
def test_planner_invariants_over_random_prompts(
    page: int, l1: int, l2: int, eviction: str, steps: list[tuple[list[int], int, bool, bool, int, bool]]
) -> None:
    planner = PrefillPlanner("P", l1, l2, page, eviction=eviction)
    tree = planner.tree
    for n, (prompt, held, pays, ok, work, runtime_order) in enumerate(steps):
        now = float(n)
        keys = page_keys(prompt, page, 7).tolist()
        on_l1, on_tree = held_prefix(tree, keys)
        plan = planner.match(keys, len(prompt), ("prefill", n), now)
        # The cached prefix is what the tree held: its L1 part, then the L2 part after it.
        assert (plan.device_pages, plan.device_pages + plan.host_pages) == (on_l1, on_tree)
        assert len(plan.device_slots) == plan.device_pages and len(plan.host_slots) == plan.host_pages
        start = on_tree
        asked: list[int] = []

        def read_s(pages: int, asked: list[int] = asked, pays: bool = pays) -> float:
            asked.append(pages)
            return 1.0 if pays else 3.0

        l3 = planner.take_l3(plan, held, read_s, lambda pages: 2.0)
        offered = min(held, len(keys) - start)
        assert asked == ([offered] if offered else [])
        assert (l3, plan.l3_declined) == ((offered, 0) if pays else (0, offered))
        assert plan.restore_pages == start + l3 <= len(keys)
        cached = plan.cached_tokens(plan.restore_pages)
        assert cached == min(plan.restore_pages * page, len(prompt) - 1) < len(prompt)

        if not runtime_order:
            planner.restored(plan)
        need = len(keys) - plan.device_pages + work
        slots = planner.reserve(plan, work)
        # Room comes from evicting everything unlocked: refused only when that cannot hold it.
        assert (slots is None) == (need > l1 - plan.device_pages)
        if slots is not None:
            assert len(slots) == need and not set(slots) & set(plan.device_slots)
            assert all(tree.device_pool.owner_of(s) == plan.owner for s in slots)
            assert plan.table() == plan.device_slots + slots
        # The locked prefix is never evicted, nor the pinned one while it is pinned.
        assert all(tree.device_pool.owner_of(s) == "tree" for s in plan.device_slots)
        assert held_prefix(tree, keys)[0] >= plan.device_pages
        if plan.pin is not None:
            assert all(tree.host_pool.owner_of(s) == "tree" for s in plan.host_slots)
        planner.restored(plan)

        planner.finish(plan, now + 0.5, insert=ok)
        if ok and slots is not None:
            # What it computed and restored is all cached now, on L1.
            assert held_prefix(tree, keys)[0] == len(keys)
        else:
            assert held_prefix(tree, keys)[0] <= plan.device_pages
        assert_consistent(planner)
        free = (tree.device_pool.num_free, tree.host_pool.num_free)
        planner.finish(plan, now + 0.7)  # once finished, finishing again changes nothing
        assert (tree.device_pool.num_free, tree.host_pool.num_free) == free


def test_a_failed_backup_copy_leaves_no_page_marked_backed_up() -> None:
    copied: list[Backup] = []

    def refuse(c: Backup) -> bool:
        copied.append(c)
        return False

    planner = PrefillPlanner("P", 4, 4, 2, copy_backup=refuse)
    keys = page_keys([1, 2, 3, 4, 5], 2, 0).tolist()
    plan = planner.match(keys, 5, "a", 0.0)
    assert planner.reserve(plan, 1) is not None
    planner.finish(plan, 1.0)
    assert copied and planner.tree.host_pages == 0
    assert_consistent(planner)


def test_a_prompt_that_fits_l1_needs_its_pages_and_a_work_page() -> None:
    planner = PrefillPlanner("P", 4, 0, 4)
    assert planner.fits(12) and planner.fits(9)  # 3 pages + 1
    assert not planner.fits(13)  # 4 pages + 1
    assert planner.fits(16, work_pages=0)


@pytest.mark.parametrize(
    ("start", "split", "want"),
    [
        (10, (4, 4, 4), (4, 4, 2)),
        (3, (4, 4, 4), (3, 0, 0)),
        (12, (0, 8, 8), (0, 8, 4)),
        (0, (4, 4, 4), (0, 0, 0)),
    ],
)
def test_cached_tokens_are_attributed_in_prompt_order(
    start: int, split: tuple[int, int, int], want: tuple[int, int, int]
) -> None:
    assert attribute(start, *split) == want


def test_a_plan_counts_every_page_but_the_last_token() -> None:
    plan = PrefillPlan("a", [1, 2], 8, 4, 2, 0, [0, 1], [], None, None)
    assert plan.cached_tokens(2) == 7 and plan.cached_tokens(1) == 4 and plan.cached_tokens(0) == 0


def tiers(tree: TieredRadixTree) -> tuple[set[int], set[int]]:
    """The keys of the pages on L1 and on L2."""
    nodes = tree.nodes()
    return (
        {k for n in nodes if n.device is not None for k in n.keys},
        {k for n in nodes if n.host is not None for k in n.keys},
    )


@SETTINGS
@given(
    page=st.integers(1, 3),
    l1=st.integers(1, 8),
    l2=st.integers(0, 10),
    eviction=st.sampled_from(["lru", "lfu", "fifo", "mru"]),
    steps=st.lists(st.tuples(prompts, st.integers(0, 8), st.booleans()), min_size=1, max_size=25),
)
def test_the_simulators_and_the_runtimes_call_orders_decide_alike(
    page: int, l1: int, l2: int, eviction: str, steps: list[tuple[list[int], int, bool]]
) -> None:
    """The simulator reserves when a prompt ends, unpinned and with no work page; the runtime
    before computing, pinned, with one work page in an L1 one page larger. On prompts that fit,
    both count the same cached pages and hold the same pages on each tier after every prompt."""
    sim = PrefillPlanner("P0", l1, l2, page, eviction=eviction)
    run = PrefillPlanner("prefill", l1 + 1, l2, page, eviction=eviction)
    for n, (prompt, held, pays) in enumerate(steps):
        if not run.fits(len(prompt)):
            continue  # the runtime computes it without its cache
        keys = page_keys(prompt, page, 3).tolist()
        done: list[int] = []
        for planner, runtime in ((sim, False), (run, True)):
            plan = planner.match(keys, len(prompt), ("prefill", n), float(n))
            planner.take_l3(plan, held, lambda pages, pays=pays: 1.0 if pays else 3.0, lambda pages: 2.0)
            if runtime:
                assert planner.reserve(plan, 1) is not None  # it fits, and nothing else holds L1
                planner.restored(plan)
            else:
                planner.restored(plan)
                planner.reserve(plan)
            planner.finish(plan, n + 0.5)
            done.append(plan.cached_tokens(plan.restore_pages))
        assert done[0] == done[1]
        assert tiers(sim.tree) == tiers(run.tree)
