"""Example-based behaviour tests of TieredRadixTree: match/insert, locks and pins, eviction
order per policy, write policies, L3 stores, and the structural check.

Keys are small distinct ints (plus one test with realistic chained keys from `page_keys`);
every scenario ends with `tree.check()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from hicache.core.commands import Backup, Command, Store
from hicache.core.errors import CoreError, LockError, PolicyError
from hicache.core.node import TreeNode
from hicache.core.pool import SlotPool
from hicache.core.tree import TREE, BackupResult, EvictResult, InsertResult, TieredRadixTree

REQ = "req"


def make_tree(l1: int = 16, l2: int = 16, **kwargs: object) -> tuple[TieredRadixTree, SlotPool, SlotPool]:
    dev = SlotPool("L1", l1)
    host = SlotPool("L2", l2)
    tree = TieredRadixTree(dev, host, **kwargs)  # type: ignore[arg-type]
    return tree, dev, host


def put(
    tree: TieredRadixTree,
    keys: Sequence[int],
    now: float = 0.0,
    owner: str = REQ,
    priority: int = 0,
) -> tuple[list[int], InsertResult]:
    """Allocate one L1 slot per page for `owner` and insert `keys` with them."""
    slots = tree.device_pool.alloc(len(keys), owner)
    assert slots is not None, "test setup: L1 pool too small"
    result = tree.insert(keys, slots, owner, now, priority=priority)
    return slots, result


def one_backup(tree: TieredRadixTree) -> Backup:
    cmds = tree.drain()
    assert len(cmds) == 1 and isinstance(cmds[0], Backup), cmds
    return cmds[0]


def one_store(tree: TieredRadixTree) -> Store:
    cmds = tree.drain()
    assert len(cmds) == 1 and isinstance(cmds[0], Store), cmds
    return cmds[0]


def finish_backups(tree: TieredRadixTree) -> list[Command]:
    """Complete every Backup in the outbox; return the commands that were drained."""
    cmds = tree.drain()
    for c in cmds:
        if isinstance(c, Backup):
            tree.backup_done(c.op)
    return cmds


def node_at(tree: TieredRadixTree, keys: Sequence[int]) -> TreeNode:
    """The node holding exactly `keys` (found by walking, without touching or splitting)."""
    for n in tree.nodes():
        if n.keys == tuple(keys):
            return n
    raise AssertionError(f"no node holds exactly {list(keys)}")


def snapshot(tree: TieredRadixTree) -> tuple[object, ...]:
    nodes = sorted(
        (tuple(n.keys), tuple(n.device or ()), tuple(n.host or ()), n.lock_ref, n.hit_count)
        for n in tree.nodes()
    )
    return (
        tree.num_nodes,
        nodes,
        sorted(tree.device_pool.free_slots()),
        sorted(tree.host_pool.free_slots()),
        [tree.device_pool.owner_of(s) for s in range(tree.device_pool.capacity)],
        tree.stats.splits,
        tree.stats.inserted,
        len(tree.outbox),
    )


# ---------------------------------------------------------------------------- match / insert


def test_empty_tree_matches_nothing() -> None:
    tree, _, _ = make_tree()
    m = tree.match([1, 2, 3], now=0)
    assert (m.query_pages, m.device_pages, m.host_pages, m.l3_start, m.l3_candidate_pages) == (3, 0, 0, 0, 3)
    assert m.device_slots == [] and m.host_slots == []
    assert m.device_node is tree.root and m.host_node is tree.root
    empty = tree.match([], now=0)
    assert (empty.query_pages, empty.l3_start) == (0, 0)
    assert tree.num_nodes == 0
    tree.check()


def test_insert_then_match_full_extension_prefix_and_diverging() -> None:
    tree, dev, _ = make_tree(write_policy="write_back")
    dev.alloc(2, "other")  # so the request's slots are not simply 0..n-1
    slots, res = put(tree, [11, 12, 13, 14])
    assert slots == [2, 3, 4, 5]
    assert res == InsertResult(cached_pages=0, adopted_pages=4)
    assert tree.num_nodes == 1
    assert dev.owned_by(TREE) == [2, 3, 4, 5] and dev.owned_by(REQ) == []

    full = tree.match([11, 12, 13, 14], now=1)
    assert (full.device_pages, full.host_pages, full.l3_start, full.l3_candidate_pages) == (4, 0, 4, 0)
    assert full.device_slots == [2, 3, 4, 5]

    ext = tree.match([11, 12, 13, 14, 15, 16], now=2)
    assert (ext.query_pages, ext.device_pages, ext.host_pages, ext.l3_start) == (6, 4, 0, 4)
    assert ext.l3_candidate_pages == 2
    assert ext.device_slots == [2, 3, 4, 5]
    assert tree.num_nodes == 1 and tree.stats.splits == 0

    # A match ending inside the node splits it so the anchor holds exactly the matched pages.
    pre = tree.match([11, 12], now=3)
    assert (pre.device_pages, pre.host_pages, pre.l3_start) == (2, 0, 2)
    assert pre.device_slots == [2, 3]
    assert tree.num_nodes == 2 and tree.stats.splits == 1
    assert pre.device_node.keys == (11, 12) and pre.device_node.device == (2, 3)
    assert pre.host_node is pre.device_node
    assert node_at(tree, [13, 14]).device == (4, 5)

    div = tree.match([11, 12, 13, 99, 100], now=4)
    assert (div.device_pages, div.host_pages, div.l3_start, div.l3_candidate_pages) == (3, 0, 3, 2)
    assert div.device_slots == [2, 3, 4]
    assert div.device_node.keys == (13,) and div.device_node.device == (4,)
    assert tree.num_nodes == 3 and tree.stats.splits == 2

    miss = tree.match([99, 11, 12], now=5)
    assert (miss.device_pages, miss.host_pages, miss.l3_start) == (0, 0, 0)
    assert miss.device_node is tree.root
    assert tree.stats.matched_device == 4 + 4 + 2 + 3
    tree.check()


def test_match_counts_a_use_of_every_matched_node() -> None:
    tree, _, _ = make_tree(write_policy="write_back")
    put(tree, [1, 2])
    put(tree, [1, 2, 3])
    assert node_at(tree, [1, 2]).hit_count == 1 and node_at(tree, [3]).hit_count == 1
    tree.match([1, 2, 3], now=7)
    tree.match([1, 2], now=8)
    assert node_at(tree, [1, 2]).hit_count == 3
    assert node_at(tree, [3]).hit_count == 2
    assert node_at(tree, [1, 2]).last_access == 8 and node_at(tree, [3]).last_access == 7


def test_realistic_chained_page_keys() -> None:
    from hicache.core.pages import page_keys

    tokens = np.arange(40, dtype=np.int64)
    keys = page_keys(tokens, 4, 7)
    assert len(keys) == 10
    tree, _, _ = make_tree(write_policy="write_back")
    slots, res = put(tree, keys)
    assert res == InsertResult(0, 10)
    # Same tokens up to page 4, different afterwards: chained keys share exactly 4 pages.
    other = tokens.copy()
    other[17] = 999
    m = tree.match(page_keys(other, 4, 7), now=1)
    assert (m.device_pages, m.host_pages, m.l3_start) == (4, 0, 4)
    assert m.device_slots == slots[:4]
    # A different seed (namespace) shares nothing.
    assert tree.match(page_keys(tokens, 4, 8), now=2).device_pages == 0
    tree.check()


def test_insert_of_cached_prefix_frees_duplicates_and_adopts_only_new_pages() -> None:
    tree, dev, _ = make_tree(l1=16, write_policy="write_back")
    first, res1 = put(tree, [1, 2, 3], owner="r1")
    assert first == [0, 1, 2] and res1 == InsertResult(0, 3)
    second = dev.alloc(5, "r2")
    assert second == [3, 4, 5, 6, 7]
    res2 = tree.insert([1, 2, 3, 4, 5], second, "r2", now=1)
    assert res2 == InsertResult(cached_pages=3, adopted_pages=2)
    assert dev.num_free == 16 - 5
    assert [dev.owner_of(s) for s in (3, 4, 5)] == [None, None, None]
    assert dev.owned_by("r2") == [] and dev.owned_by("r1") == []
    assert dev.owned_by(TREE) == [0, 1, 2, 6, 7]
    assert tree.stats.inserted == 5
    m = tree.match([1, 2, 3, 4, 5], now=2)
    assert m.device_slots == [0, 1, 2, 6, 7]

    # Inserting a fully cached sequence again adopts nothing and frees every slot given.
    again, res3 = put(tree, [1, 2, 3, 4, 5], owner="r3")
    assert res3 == InsertResult(cached_pages=5, adopted_pages=0)
    assert dev.num_free == 16 - 5 and dev.owned_by("r3") == []
    assert all(dev.owner_of(s) is None for s in again)
    tree.check()


def test_insert_inside_a_node_splits_it_and_adds_the_tail() -> None:
    tree, dev, _ = make_tree(write_policy="write_back")
    put(tree, [1, 2, 3, 4])
    slots, res = put(tree, [1, 2, 9], owner="r2")
    assert res == InsertResult(cached_pages=2, adopted_pages=1)
    assert tree.num_nodes == 3 and tree.stats.splits == 1
    assert sorted(n.keys for n in tree.nodes()) == [(1, 2), (3, 4), (9,)]
    assert node_at(tree, [9]).device == (slots[2],)
    assert dev.owner_of(slots[0]) is None and dev.owner_of(slots[1]) is None
    tree.check()


def test_insert_may_pass_the_trees_own_slots_for_the_cached_prefix() -> None:
    tree, dev, _ = make_tree(write_policy="write_back")
    held, _ = put(tree, [1, 2, 3])
    tail = dev.alloc(1, REQ)
    assert tail is not None
    res = tree.insert([1, 2, 3, 4], held + tail, REQ, now=1)
    assert res == InsertResult(cached_pages=3, adopted_pages=1)
    assert dev.owned_by(TREE) == held + tail  # the tree's own slots were not freed
    assert tree.match([1, 2, 3, 4], now=2).device_slots == held + tail
    tree.check()


def test_insert_with_mismatched_slot_count_changes_nothing() -> None:
    tree, dev, _ = make_tree(write_policy="write_through")
    put(tree, [1, 2, 3, 4])
    tree.drain()
    slots = dev.alloc(2, REQ)
    assert slots is not None
    before = snapshot(tree)
    with pytest.raises(CoreError, match=r"3 page keys but 2 device slots"):
        tree.insert([1, 2, 9], slots, REQ, now=1)
    assert snapshot(tree) == before
    assert dev.owned_by(REQ) == slots
    tree.check()


@pytest.mark.parametrize("bad", ["other_owner", "free_slot", "out_of_range", "repeated"])
def test_insert_with_slots_not_owned_by_owner_changes_nothing(bad: str) -> None:
    tree, dev, _ = make_tree(l1=8, write_policy="write_through")
    put(tree, [1, 2, 3, 4])  # slots 0..3
    tree.drain()
    mine = dev.alloc(2, REQ)  # [4, 5]
    theirs = dev.alloc(1, "other")  # [6]
    assert mine == [4, 5] and theirs == [6]
    # The error names the bad slot (a repeated one only needs to be refused).
    slots, message = {
        "other_owner": ([4, 5, 6], r"\b6\b"),
        "free_slot": ([4, 5, 7], r"\b7\b"),
        "out_of_range": ([4, 5, 8], r"\b8\b"),
        "repeated": ([4, 5, 5], None),
    }[bad]
    before = snapshot(tree)
    # [1, 2, 9] ends inside node [1, 2, 3, 4]: a bad call must not even split it.
    with pytest.raises(CoreError, match=message):
        tree.insert([1, 2, 9], slots, REQ, now=1)
    assert snapshot(tree) == before
    assert tree.stats.splits == 0 and tree.num_nodes == 1
    assert dev.owned_by(REQ) == [4, 5] and dev.owned_by("other") == [6]
    tree.check()


def test_host_only_nodes_are_readopted_on_insert_without_a_new_backup() -> None:
    tree, dev, host = make_tree(write_policy="write_through")
    put(tree, [1, 2])
    b = one_backup(tree)
    tree.backup_done(b.op)
    assert tree.evict_device(2).demoted_keys == [1, 2]
    slots, res = put(tree, [1, 2], now=1, owner="r2")
    assert res == InsertResult(cached_pages=0, adopted_pages=2)
    assert tree.drain() == []  # the L2 copy is still valid
    m = tree.match([1, 2], now=2)
    assert (m.device_pages, m.host_pages) == (2, 0) and m.device_slots == slots
    assert host.owned_by(TREE) == list(b.host_slots)
    assert dev.owned_by(TREE) == slots
    tree.check()


# ---------------------------------------------------------------------------- locks


def test_locked_path_survives_eviction_until_unlocked() -> None:
    tree, dev, _ = make_tree(l1=16, l2=0, write_policy="write_back")
    put(tree, [1, 2, 3], now=0)
    put(tree, [1, 2, 7, 8], now=1)
    m = tree.match([1, 2, 3], now=2)
    assert m.device_node.keys == (3,)
    receipt = tree.lock(m.device_node)
    assert tree.live_locks == [receipt]
    assert node_at(tree, [3]).lock_ref == 1 and node_at(tree, [1, 2]).lock_ref == 1
    assert node_at(tree, [7, 8]).lock_ref == 0
    tree.check()

    res = tree.evict_device(10**6)
    assert res == EvictResult(freed=2, pending=0, demoted_keys=[], dropped_keys=[7, 8])
    assert tree.device_pages == 3
    assert tree.match([1, 2, 3], now=3).device_pages == 3
    tree.check()

    tree.unlock(receipt)
    assert tree.live_locks == []
    res = tree.evict_device(10**6)
    assert res == EvictResult(freed=3, pending=0, demoted_keys=[], dropped_keys=[3, 1, 2])
    assert tree.num_nodes == 0 and dev.num_free == 16
    tree.check()


def test_unlock_twice_raises() -> None:
    tree, _, _ = make_tree(write_policy="write_back")
    put(tree, [1, 2])
    receipt = tree.lock(tree.match([1, 2], now=1).device_node)
    tree.unlock(receipt)
    with pytest.raises(LockError, match=rf"lock receipt #{receipt.serial} is not held on this tree"):
        tree.unlock(receipt)
    assert node_at(tree, [1, 2]).lock_ref == 0
    tree.check()


def test_receipt_from_another_tree_raises_even_with_a_colliding_serial() -> None:
    t1, _, _ = make_tree(write_policy="write_back")
    t2, _, _ = make_tree(write_policy="write_back")
    put(t1, [1, 2])
    put(t2, [1, 2])
    r1 = t1.lock(t1.match([1, 2], now=1).device_node)
    r2 = t2.lock(t2.match([1, 2], now=1).device_node)
    assert r1.serial == r2.serial  # serials are per tree: only the tree id tells them apart
    with pytest.raises(LockError):
        t2.unlock(r1)
    assert t2.live_locks == [r2] and node_at(t2, [1, 2]).lock_ref == 1
    assert t1.live_locks == [r1] and node_at(t1, [1, 2]).lock_ref == 1
    t1.check()
    t2.check()


def test_lock_on_node_without_l1_slots_raises() -> None:
    tree, _, _ = make_tree(write_policy="write_through")
    put(tree, [1, 2])
    finish_backups(tree)
    assert tree.evict_device(2).demoted_keys == [1, 2]
    m = tree.match([1, 2], now=1)
    assert m.device_node is tree.root and m.host_node.keys == (1, 2)
    with pytest.raises(LockError, match=r"holds no L1 slots"):
        tree.lock(m.host_node)
    assert tree.live_locks == [] and m.host_node.lock_ref == 0
    tree.check()


def test_receipt_survives_a_split_of_its_node() -> None:
    tree, dev, _ = make_tree(l1=16, l2=0, write_policy="write_back")
    put(tree, [1, 2, 3, 4])
    receipt = tree.lock(tree.match([1, 2, 3, 4], now=1).device_node)
    put(tree, [1, 2, 9], now=2, owner="r2")  # splits the locked node into [1, 2] + [3, 4]
    assert tree.stats.splits == 1
    assert node_at(tree, [1, 2]).lock_ref == 1 and node_at(tree, [3, 4]).lock_ref == 1
    assert receipt.node is node_at(tree, [3, 4])
    tree.check()

    # The lock still protects the whole original path: only the unlocked leaf goes.
    res = tree.evict_device(10**6)
    assert res.freed == 1 and res.dropped_keys == [9]
    assert tree.match([1, 2, 3, 4], now=3).device_pages == 4

    tree.unlock(receipt)
    assert [n.lock_ref for n in tree.nodes()] == [0, 0]
    tree.check()
    res = tree.evict_device(10**6)
    assert res.freed == 4 and res.dropped_keys == [3, 4, 1, 2]
    assert dev.num_free == 16 and tree.num_nodes == 0
    tree.check()


def test_lock_on_split_anchor_protects_only_the_matched_pages() -> None:
    tree, _, _ = make_tree(l2=0, write_policy="write_back")
    put(tree, [1, 2, 3, 4])
    m = tree.match([1, 2, 7], now=1)
    assert m.device_node.keys == (1, 2)
    receipt = tree.lock(m.device_node)
    res = tree.evict_device(10**6)
    assert res.freed == 2 and res.dropped_keys == [3, 4]
    assert [n.keys for n in tree.nodes()] == [(1, 2)]
    tree.unlock(receipt)
    assert tree.evict_device(10**6).dropped_keys == [1, 2]
    tree.check()


# ---------------------------------------------------------------------------- pins


def test_pin_host_protects_host_only_nodes_from_evict_host() -> None:
    tree, _, host = make_tree(l2=8, write_policy="write_through")
    put(tree, [1, 2], now=0)
    put(tree, [1, 2, 3], now=1)
    finish_backups(tree)
    res = tree.evict_device(10**6)
    assert res == EvictResult(freed=3, pending=0, demoted_keys=[3, 1, 2], dropped_keys=[])
    m = tree.match([1, 2, 3], now=2)
    assert (m.device_pages, m.host_pages) == (0, 3)
    pin = tree.pin_host(m.host_node)
    assert tree.live_pins == [pin]
    assert node_at(tree, [1, 2]).host_ref == 1 and node_at(tree, [3]).host_ref == 1
    tree.check()

    assert tree.evict_host(10**6) == EvictResult(0, 0, [], [])
    assert tree.host_pages == 3
    tree.unpin_host(pin)
    with pytest.raises(LockError, match=r"is not held on this tree"):
        tree.unpin_host(pin)
    res = tree.evict_host(10**6)
    assert res == EvictResult(freed=3, pending=0, demoted_keys=[], dropped_keys=[3, 1, 2])
    assert host.num_free == 8 and tree.num_nodes == 0
    tree.check()


def test_pin_on_inner_node_lets_its_unpinned_child_go() -> None:
    tree, _, _ = make_tree(write_policy="write_through")
    put(tree, [1, 2], now=0)
    put(tree, [1, 2, 3], now=1)
    finish_backups(tree)
    tree.evict_device(10**6)
    pin = tree.pin_host(tree.match([1, 2], now=2).host_node)
    assert tree.evict_host(10**6).dropped_keys == [3]
    assert [n.keys for n in tree.nodes()] == [(1, 2)]
    tree.unpin_host(pin)
    tree.check()


def test_pin_survives_a_split_of_its_node() -> None:
    tree, _, host = make_tree(l2=8, write_policy="write_through")
    put(tree, [1, 2, 3, 4])
    finish_backups(tree)
    tree.evict_device(10**6)
    pin = tree.pin_host(tree.match([1, 2, 3, 4], now=1).host_node)
    m = tree.match([1, 2], now=2)  # ends inside the pinned node: splits it
    assert tree.stats.splits == 1 and m.host_pages == 2 and m.host_node.keys == (1, 2)
    assert node_at(tree, [1, 2]).host_ref == 1 and node_at(tree, [3, 4]).host_ref == 1
    tree.check()
    assert tree.evict_host(10**6) == EvictResult(0, 0, [], [])
    tree.unpin_host(pin)
    assert [n.host_ref for n in tree.nodes()] == [0, 0]
    tree.check()
    assert tree.evict_host(10**6).dropped_keys == [3, 4, 1, 2]
    assert host.num_free == 8
    tree.check()


def test_pin_on_device_only_node_raises() -> None:
    tree, _, _ = make_tree(write_policy="write_back")
    put(tree, [1, 2])
    node = tree.match([1, 2], now=1).device_node
    assert node.host is None
    with pytest.raises(LockError, match=r"holds no L2 slots"):
        tree.pin_host(node)
    assert tree.live_pins == [] and node.host_ref == 0
    tree.check()


# ---------------------------------------------------------------------------- eviction order


# Four single-page leaves under the root, with (insert time, priority) and one extra use of 30:
#   10: created 1st, last use 5, 1 hit,  priority 2
#   20: created 2nd, last use 1, 1 hit,  priority 1
#   30: created 3rd, last use 4, 2 hits, priority 0
#   40: created 4th, last use 2, 1 hit,  priority 0
EXPECTED_ORDER = {
    "lru": [20, 40, 30, 10],
    "mru": [10, 30, 40, 20],
    "lfu": [20, 40, 10, 30],
    "fifo": [10, 20, 30, 40],
    "priority": [40, 30, 20, 10],
}


@pytest.mark.parametrize("policy", sorted(EXPECTED_ORDER))
def test_eviction_order_per_policy(policy: str) -> None:
    tree, dev, _ = make_tree(l2=0, eviction=policy, write_policy="write_back")
    put(tree, [10], now=5, priority=2)
    put(tree, [20], now=1, priority=1)
    put(tree, [30], now=3, priority=0)
    put(tree, [40], now=2, priority=0)
    tree.match([30], now=4)
    order = []
    for _ in range(4):
        res = tree.evict_device(1)
        assert res.freed == 1 and res.pending == 0 and res.demoted_keys == []
        order.extend(res.dropped_keys)
    assert order == EXPECTED_ORDER[policy]
    assert tree.evict_device(1) == EvictResult(0, 0, [], [])
    assert dev.num_free == dev.capacity
    tree.check()


@pytest.mark.parametrize("policy", ["lru", "mru"])
def test_eviction_ties_break_by_creation_order(policy: str) -> None:
    tree, _, _ = make_tree(l2=0, eviction=policy, write_policy="write_back")
    for k in (7, 5, 9):
        put(tree, [k], now=3)
    assert [tree.evict_device(1).dropped_keys[0] for _ in range(3)] == [7, 5, 9]


def test_priority_of_a_node_is_the_max_over_inserts() -> None:
    tree, _, _ = make_tree(l2=0, eviction="priority", write_policy="write_back")
    put(tree, [1], now=0, priority=0)
    put(tree, [2], now=1, priority=1)
    put(tree, [1], now=2, priority=5)  # re-insert raises [1]'s priority
    put(tree, [1], now=3, priority=0)  # ... and a lower one does not lower it
    assert node_at(tree, [1]).priority == 5
    assert tree.evict_device(1).dropped_keys == [2]


def test_unknown_eviction_policy_lists_known_names() -> None:
    with pytest.raises(PolicyError) as err:
        make_tree(eviction="random")
    assert isinstance(err.value, ValueError)
    assert str(err.value) == (
        "unknown eviction policy 'random'; expected one of: fifo, lfu, lru, mru, priority"
    )


def test_unknown_write_policy_raises_policy_error() -> None:
    with pytest.raises(PolicyError) as err:
        make_tree(write_policy="write_around")
    assert isinstance(err.value, ValueError)
    assert str(err.value) == (
        "unknown write policy 'write_around'; expected one of: "
        "write_through, write_through_selective, write_back"
    )


# ---------------------------------------------------------------------------- write policies


def test_write_through_backs_up_each_insert_of_new_pages() -> None:
    tree, dev, host = make_tree(l1=16, l2=16, write_policy="write_through")
    dev.alloc(1, "other")
    host.alloc(4, "other")
    slots, _ = put(tree, [1, 2, 3], now=0)
    assert slots == [1, 2, 3]
    b1 = one_backup(tree)
    assert b1 == Backup(op=1, device_slots=(1, 2, 3), host_slots=(4, 5, 6))
    assert host.owned_by(TREE) == [4, 5, 6]
    assert node_at(tree, [1, 2, 3]).host_pending

    # Until the backup completes, the node stays on L1 and counts as an L1 hit.
    assert tree.evict_device(10**6) == EvictResult(0, 0, [], [])
    m = tree.match([1, 2, 3], now=1)
    assert (m.device_pages, m.host_pages) == (3, 0)

    put(tree, [1, 2, 3], now=2, owner="dup")
    assert tree.drain() == []  # nothing new: no Backup
    ext, _ = put(tree, [1, 2, 3, 7, 8], now=3)
    b2 = one_backup(tree)
    assert b2 == Backup(op=2, device_slots=tuple(ext[3:]), host_slots=(7, 8))
    tree.check()

    assert tree.backup_done(b1.op) == BackupResult(backed_keys=[1, 2, 3], demoted_keys=[])
    assert tree.backup_done(b2.op) == BackupResult(backed_keys=[7, 8], demoted_keys=[])
    assert not node_at(tree, [1, 2, 3]).host_pending
    assert tree.stats.backed_up == 5

    res = tree.evict_device(10**6)
    assert res == EvictResult(freed=5, pending=0, demoted_keys=[7, 8, 1, 2, 3], dropped_keys=[])
    assert dev.owned_by(TREE) == [] and dev.num_free == 15
    m = tree.match([1, 2, 3, 7, 8], now=4)
    assert (m.device_pages, m.host_pages, m.l3_start) == (0, 5, 5)
    assert m.host_slots == list(b1.host_slots + b2.host_slots)
    assert m.device_node is tree.root and m.host_node.keys == (7, 8)
    assert tree.stats.demoted == 5
    tree.check()


def test_write_through_selective_backs_up_on_second_use() -> None:
    tree, _, _ = make_tree(write_policy="write_through_selective")
    slots, _ = put(tree, [1, 2], now=0)
    assert tree.drain() == []
    tree.match([1, 2], now=1)
    b = one_backup(tree)
    assert b == Backup(op=1, device_slots=tuple(slots), host_slots=(0, 1))
    tree.match([1, 2], now=2)
    assert tree.drain() == []  # already has its L2 copy
    tree.backup_done(b.op)

    # A child used once is not backed up; its second use backs up the child only.
    child, _ = put(tree, [1, 2, 3], now=3)
    assert tree.drain() == []
    tree.match([1, 2, 3], now=4)
    assert one_backup(tree) == Backup(op=2, device_slots=(child[2],), host_slots=(2,))
    tree.check()


def test_write_through_selective_backs_up_parent_with_child() -> None:
    tree, _, _ = make_tree(write_policy="write_through_selective")
    parent, _ = put(tree, [1, 2], now=0)
    child, _ = put(tree, [1, 2, 3], now=1)
    assert tree.drain() == []
    tree.match([1, 2, 3], now=2)
    b = one_backup(tree)
    assert b == Backup(op=1, device_slots=(parent[0], parent[1], child[2]), host_slots=(0, 1, 2))
    assert node_at(tree, [1, 2]).host == (0, 1) and node_at(tree, [3]).host == (2,)
    tree.check()


def test_write_back_backs_up_on_eviction_then_demotes() -> None:
    tree, dev, host = make_tree(l1=8, l2=8, write_policy="write_back")
    host.alloc(3, "other")
    slots, _ = put(tree, [1, 2, 3], now=0)
    assert tree.drain() == []
    res = tree.evict_device(3)
    assert res == EvictResult(freed=0, pending=3, demoted_keys=[], dropped_keys=[])
    b = one_backup(tree)
    assert b == Backup(op=1, device_slots=tuple(slots), host_slots=(3, 4, 5))
    assert dev.num_free == 5  # nothing freed yet
    assert tree.match([1, 2, 3], now=1).device_pages == 3
    assert tree.evict_device(3) == EvictResult(0, 0, [], [])  # in flight: not evicted twice
    assert tree.drain() == []
    tree.check()

    done = tree.backup_done(b.op)
    assert done == BackupResult(backed_keys=[1, 2, 3], demoted_keys=[1, 2, 3])
    assert dev.num_free == 8
    m = tree.match([1, 2, 3], now=2)
    assert (m.device_pages, m.host_pages) == (0, 3)
    assert m.host_slots == [3, 4, 5]
    tree.check()


def test_write_back_never_backs_up_a_child_before_its_parent() -> None:
    tree, _, _ = make_tree(write_policy="write_back")
    parent, _ = put(tree, [1, 2], now=0)
    child, _ = put(tree, [1, 2, 3], now=1)
    res = tree.evict_device(1)
    assert res == EvictResult(freed=0, pending=1, demoted_keys=[], dropped_keys=[])
    b = one_backup(tree)
    assert b == Backup(op=1, device_slots=(parent[0], parent[1], child[2]), host_slots=(0, 1, 2))
    assert tree.backup_done(b.op) == BackupResult(backed_keys=[1, 2, 3], demoted_keys=[3])
    m = tree.match([1, 2, 3], now=2)
    assert (m.device_pages, m.host_pages) == (2, 1)
    assert m.device_slots == parent and m.host_slots == [2]
    # The parent already has its copy: evicting it now demotes it at once, with no new Backup.
    assert tree.evict_device(2) == EvictResult(2, 0, [1, 2], [])
    assert tree.drain() == []
    tree.check()


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
def test_l2_capacity_zero_drops_on_eviction(write_policy: str) -> None:
    tree, dev, _ = make_tree(l1=8, l2=0, write_policy=write_policy)
    put(tree, [1, 2, 3], now=0)
    tree.match([1, 2, 3], now=1)  # a second use, for the selective policy
    assert tree.drain() == []
    res = tree.evict_device(3)
    assert res == EvictResult(freed=3, pending=0, demoted_keys=[], dropped_keys=[1, 2, 3])
    assert tree.drain() == []
    assert tree.stats.backup_failed == 3 and tree.stats.dropped == 3
    m = tree.match([1, 2, 3], now=2)
    assert (m.device_pages, m.host_pages, m.l3_start) == (0, 0, 0)
    assert tree.num_nodes == 0 and dev.num_free == 8
    tree.check()


def test_full_l2_is_made_room_for_by_evict_host_and_tells_the_hook() -> None:
    evicted: list[list[int]] = []
    tree, _, host = make_tree(l2=2, write_policy="write_through", on_host_evict=evicted.append)
    put(tree, [1, 2], now=0)
    first = one_backup(tree)
    tree.backup_done(first.op)
    tree.evict_device(2)
    assert host.num_free == 0
    put(tree, [5, 6], now=1)
    second = one_backup(tree)
    assert evicted == [[1, 2]]
    assert second.host_slots == first.host_slots
    assert tree.match([1, 2], now=2).l3_start == 0
    tree.check()


# ---------------------------------------------------------------------------- L3 stores


def test_store_to_l3_after_backup_and_host_eviction_after_store() -> None:
    evicted: list[list[int]] = []
    tree, _, host = make_tree(write_policy="write_through", store_to_l3=True, on_host_evict=evicted.append)
    put(tree, [1, 2], now=0)
    b = one_backup(tree)
    assert tree.ops_in_flight == [b.op]
    assert tree.backup_done(b.op) == BackupResult([1, 2], [])
    s = one_store(tree)
    assert s == Store(op=2, keys=(1, 2), host_slots=b.host_slots)
    assert tree.ops_in_flight == [2]

    assert tree.evict_device(2).demoted_keys == [1, 2]
    # In flight to L3: the L2 copy must stay.
    assert tree.evict_host(10**6) == EvictResult(0, 0, [], [])
    assert evicted == []
    node = node_at(tree, [1, 2])
    assert node.host == b.host_slots and not node.in_l3
    tree.check()

    assert tree.store_done(s.op) == [1, 2]
    assert node.in_l3 and tree.stats.stored == 2 and tree.ops_in_flight == []

    # Pages already in L3 are not stored again: an extension stores only its new pages.
    put(tree, [1, 2, 3], now=1)
    b2 = one_backup(tree)
    tree.backup_done(b2.op)
    s2 = one_store(tree)
    assert s2.keys == (3,) and s2.host_slots == b2.host_slots
    tree.store_done(s2.op)
    tree.evict_device(10**6)
    res = tree.evict_host(10**6)
    assert res == EvictResult(freed=3, pending=0, demoted_keys=[], dropped_keys=[3, 1, 2])
    assert evicted == [[3, 1, 2]]
    assert host.num_free == host.capacity
    assert tree.match([1, 2, 3], now=2).l3_start == 0
    tree.check()


def test_store_in_flight_covers_both_halves_of_a_split_node() -> None:
    tree, _, _ = make_tree(write_policy="write_through", store_to_l3=True)
    put(tree, [1, 2, 3, 4])
    finish_backups(tree)
    s = one_store(tree)
    assert s.keys == (1, 2, 3, 4)
    tree.evict_device(10**6)
    tree.match([1, 2], now=1)  # splits the node while its store is in flight
    assert tree.evict_host(10**6) == EvictResult(0, 0, [], [])
    keys = tree.store_done(s.op)
    assert keys == [1, 2, 3, 4]  # in the order of the command's pages, although the node split
    assert node_at(tree, [1, 2]).in_l3 and node_at(tree, [3, 4]).in_l3
    assert tree.ops_in_flight == []
    assert tree.evict_host(10**6).freed == 4
    tree.check()


def test_unknown_or_finished_op_ids_raise() -> None:
    tree, _, _ = make_tree(write_policy="write_through", store_to_l3=True)
    with pytest.raises(CoreError, match=r"backup_done: no backup #99 is in flight"):
        tree.backup_done(99)
    with pytest.raises(CoreError, match=r"store_done: no store #99 is in flight"):
        tree.store_done(99)
    put(tree, [1, 2])
    b = one_backup(tree)
    with pytest.raises(CoreError, match=rf"no store #{b.op}"):
        tree.store_done(b.op)  # a backup's id is not a store's
    tree.backup_done(b.op)
    with pytest.raises(CoreError, match=rf"no backup #{b.op}"):
        tree.backup_done(b.op)  # twice
    s = one_store(tree)
    with pytest.raises(CoreError, match=rf"no backup #{s.op}"):
        tree.backup_done(s.op)  # a store's id is not a backup's
    tree.store_done(s.op)
    with pytest.raises(CoreError, match=rf"no store #{s.op}"):
        tree.store_done(s.op)
    tree.check()


# ---------------------------------------------------------------------------- check()


def _corrupt_lock_ref(tree: TieredRadixTree) -> None:
    node_at(tree, [3]).lock_ref = 1


def _corrupt_host_ref(tree: TieredRadixTree) -> None:
    node_at(tree, [1, 2]).host_ref = 2


def _corrupt_dev_children(tree: TieredRadixTree) -> None:
    node_at(tree, [1, 2]).dev_children = 0


def _corrupt_num_nodes(tree: TieredRadixTree) -> None:
    tree.num_nodes += 1


def _corrupt_shared_slot(tree: TieredRadixTree) -> None:
    node_at(tree, [3]).device = (node_at(tree, [1, 2]).device[0],)  # type: ignore[index]


def _corrupt_pool_owner(tree: TieredRadixTree) -> None:
    tree.device_pool.transfer(node_at(tree, [3]).device, TREE, "thief")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_lock_ref, r"lock_ref 1, receipts say 0"),
        (_corrupt_host_ref, r"host_ref 2, pins say 0"),
        (_corrupt_dev_children, r"dev_children 0, actual 1"),
        (_corrupt_num_nodes, r"num_nodes 3, found 2"),
        (_corrupt_shared_slot, r"L1 slot \d+ held by two nodes"),
        (_corrupt_pool_owner, r"L1 pool gives the tree 2 slots, nodes hold 3"),
    ],
)
def test_check_detects_a_corrupted_tree(corrupt: Callable[[TieredRadixTree], None], message: str) -> None:
    tree, _, _ = make_tree(write_policy="write_back")
    put(tree, [1, 2], now=0)
    put(tree, [1, 2, 3], now=1)
    tree.check()
    corrupt(tree)
    with pytest.raises(CoreError, match=message):
        tree.check()


# ---------------------------------------------------------------------------- known bugs


def _chain_of_three(eviction: str, l2: int) -> tuple[TieredRadixTree, SlotPool]:
    tree, dev, _ = make_tree(l1=8, l2=l2, eviction=eviction, write_policy="write_through")
    put(tree, [1], now=0)
    put(tree, [1, 2], now=0)
    put(tree, [1, 2, 3], now=0)
    return tree, dev


def test_evict_device_frees_every_unlocked_page_after_heavy_use() -> None:
    # Each match pushes 3 heap entries; somewhere in this range the heap sits just under its
    # compaction bound (4 * num_nodes + 1024) when eviction starts.
    shortfalls = {}
    for uses in range(330, 356):
        tree, dev = _chain_of_three("mru", l2=0)
        for now in range(1, uses + 1):
            tree.match([1, 2, 3], now=now)
        res = tree.evict_device(10**6)
        if res.freed != 3:
            shortfalls[uses] = res
        tree.check()
    assert shortfalls == {}


def test_evict_host_frees_every_unpinned_page_after_heavy_use() -> None:
    shortfalls = {}
    for uses in range(1020, 1046):
        tree, _ = _chain_of_three("mru", l2=8)
        finish_backups(tree)
        assert tree.evict_device(10**6).demoted_keys == [3, 2, 1]
        for now in range(1, uses + 1):
            tree.match([1, 2, 3], now=now)  # each use pushes the host-only leaf once
        res = tree.evict_host(10**6)
        if res.freed != 3:
            shortfalls[uses] = res
        tree.check()
    assert shortfalls == {}


def test_write_back_pending_eviction_survives_a_split() -> None:
    tree, dev, _ = make_tree(l1=8, l2=8, write_policy="write_back")
    put(tree, [1, 2, 3, 4], now=0)
    assert tree.evict_device(4) == EvictResult(freed=0, pending=4, demoted_keys=[], dropped_keys=[])
    b = one_backup(tree)
    tree.match([1, 2], now=1)  # ends inside the node: splits it while the backup is in flight
    done = tree.backup_done(b.op)
    tree.check()
    assert sorted(done.demoted_keys) == [1, 2, 3, 4]  # the 4 pending pages free now
    assert dev.num_free == 8


def test_peek_counts_held_pages_and_changes_nothing() -> None:
    tree, _, _ = make_tree(write_policy="write_back")
    put(tree, [1, 2, 3, 4])
    before = snapshot(tree)
    assert tree.peek([1, 2, 3, 4, 5]) == 4
    assert tree.peek([1, 2, 9]) == 2  # ends inside a node: no split
    assert tree.peek([7]) == 0 and tree.peek([]) == 0
    assert snapshot(tree) == before
    assert tree.stats.splits == 0


def test_store_backlog_cap_skips_stores_instead_of_pinning_l2() -> None:
    tree, _, host = make_tree(l1=16, l2=16, store_to_l3=True, store_backlog_pages=3)
    put(tree, [1, 2], owner="a")
    tree.backup_done(one_backup(tree).op)
    first = one_store(tree)  # 2 pages waiting on storage
    put(tree, [5, 6], owner="b")
    tree.backup_done(one_backup(tree).op)
    assert tree.drain() == []  # 2 more would exceed the backlog of 3: not stored
    assert tree.stats.store_skipped == 2 and tree.store_pending == 2
    tree.store_done(first.op)
    assert tree.store_pending == 0
    # the skipped pages are evictable from L2 (nothing reads them), the stored ones in L3
    assert not node_at(tree, [5, 6]).ops and node_at(tree, [1, 2]).in_l3
    tree.check()
    assert host.num_free == 12


# ---------------------------------------------------------------------------- failed copies


def test_a_backup_failing_inside_a_node_keeps_the_l2_copies_before_it() -> None:
    tree, dev, host = make_tree()
    put(tree, [1, 2, 3, 4])
    b = one_backup(tree)
    put(tree, [1, 2, 3, 4, 5, 6])  # a child below the pending node: its own backup
    child = one_backup(tree)
    tree.backup_done(b.op, failed=(2,))  # pages 3 and 4 never reached L2
    tree.check()
    assert node_at(tree, [1, 2]).host is not None
    assert node_at(tree, [3, 4]).host is None  # on L1 only now
    assert node_at(tree, [5, 6]).host is None  # below it: L2 copies stay root-connected
    assert tree.stats.backed_up == 2
    # The child's backup still writes its old L2 slots: they are not free until it ends.
    assert host.num_free == 16 - 2 - 2
    tree.backup_done(child.op)
    tree.check()
    assert host.num_free == 16 - 2
    assert node_at(tree, [5, 6]).host is None  # its copy completed, but hangs under no L2 parent


def test_a_failed_backup_leaves_its_nodes_evictable() -> None:
    tree, dev, host = make_tree()
    put(tree, [1, 2, 3])
    b = one_backup(tree)
    tree.backup_done(b.op, failed=(0,))
    tree.check()
    assert tree.evict_device(3).freed == 3  # dropped (no L2 copy), not stuck as "pending"
    assert dev.num_free == 16 and host.num_free == 16 and tree.num_nodes == 0


def test_a_failed_write_back_backup_keeps_the_node_on_l1() -> None:
    tree, dev, host = make_tree(write_policy="write_back")
    put(tree, [1, 2])
    assert tree.evict_device(2).pending == 2
    b = one_backup(tree)
    tree.backup_done(b.op, failed=(1,))
    tree.check()
    assert node_at(tree, [1]).device is not None and node_at(tree, [2]).device is not None
    assert node_at(tree, [1]).host is not None and node_at(tree, [2]).host is None


def test_a_store_marks_exactly_the_pages_it_wrote() -> None:
    tree, _, _ = make_tree(store_to_l3=True)
    put(tree, [1, 2, 3, 4, 5])
    tree.backup_done(one_backup(tree).op)
    s = one_store(tree)
    assert tree.store_done(s.op, failed=(1, 2)) == [1, 4, 5]
    tree.check()
    assert [(n.keys, n.in_l3) for n in sorted(tree.nodes(), key=lambda n: n.keys)] == [
        ((1,), True),
        ((2, 3), False),
        ((4, 5), True),
    ]
    assert tree.stats.store_failed == 2


def test_failed_pages_outside_the_command_are_refused_without_change() -> None:
    tree, _, _ = make_tree(store_to_l3=True)
    put(tree, [1, 2])
    b = one_backup(tree)
    before = snapshot(tree)
    for bad in [(2,), (-1,)]:
        with pytest.raises(CoreError, match="outside"):
            tree.backup_done(b.op, failed=bad)
        assert snapshot(tree) == before
    tree.backup_done(b.op)
    s = one_store(tree)
    with pytest.raises(CoreError, match="outside"):
        tree.store_done(s.op, failed=(5,))
    tree.store_done(s.op)


def test_a_bad_l2_page_leaves_the_tree_once_pins_let_go() -> None:
    tree, dev, host = make_tree()
    put(tree, [1, 2, 3, 4])
    tree.backup_done(one_backup(tree).op)
    tree.evict_device(4)  # L2 only now
    m = tree.match([1, 2, 3, 4], 1.0)
    pin = tree.pin_host(m.host_node)
    assert tree.drop_host(m.host_node, 2) == 2  # page 2 is bad: it and page 3 go
    tree.check()
    assert tree.peek([1, 2, 3, 4]) == 2  # no later match reads the bad page
    assert tree.match([1, 2, 3, 4], 2.0).host_pages == 2
    assert host.num_free == 16 - 4  # the pinned slots wait for the pin
    tree.unpin_host(pin)
    tree.check()
    assert host.num_free == 16 - 2
    assert tree.drop_host(m.host_node, 2) == 0  # dropped once: a second report changes nothing
