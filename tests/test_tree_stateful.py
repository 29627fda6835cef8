"""Stateful property tests of the tiered radix tree against a plain model of the tiers.

The model is two sets of page keys (what L1 holds, what L2 holds with a valid copy), updated
only from what the tree reports (inserts, evictions, completed backups). Every match must
equal a brute-force walk over those sets, and every structural invariant must hold after
every step.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from builders import examples
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from hicache.core.commands import Backup, Store
from hicache.core.errors import LockError
from hicache.core.eviction import EVICTION_POLICIES
from hicache.core.pool import SlotPool
from hicache.core.tree import TieredRadixTree
from hicache.core.write_policy import WritePolicy

PAGE = 2


def chain_keys(tokens: tuple[int, ...], page: int = PAGE) -> list[int]:
    """Chained page keys made independently of hicache's hash (Python's tuple hash of ints is
    stable across runs), so the model does not share code with what it checks."""
    keys = []
    prev = 0x9E3779B97F4A7C15
    for i in range(len(tokens) // page):
        prev = hash((prev, tokens[i * page : (i + 1) * page])) & 0xFFFFFFFFFFFFFFFF
        keys.append(prev)
    return keys


# Small alphabets and short pages give many shared prefixes, so splits and reuse are common.
sequences = st.lists(st.integers(0, 2), min_size=0, max_size=24).map(tuple)


class TieredTreeMachine(RuleBasedStateMachine):
    locks = Bundle("locks")
    pins = Bundle("pins")

    @initialize(
        l1=st.integers(2, 40),
        l2=st.integers(0, 60),
        eviction=st.sampled_from(sorted(EVICTION_POLICIES)),
        write=st.sampled_from([p.value for p in WritePolicy]),
        store=st.booleans(),
    )
    def setup(self, l1: int, l2: int, eviction: str, write: str, store: bool) -> None:
        self.dev = SlotPool("L1", l1)
        self.host = SlotPool("L2", l2)
        self.l1: set[int] = set()
        self.l2: set[int] = set()
        self.l2_dropped: set[int] = set()  # pages the eviction hook reported in this step
        self.tree = TieredRadixTree(
            self.dev,
            self.host,
            eviction=eviction,
            write_policy=write,
            store_to_l3=store,
            on_host_evict=self._host_evicted,
        )
        self.backups: list[Backup] = []
        self.stores: list[Store] = []
        self.clock = itertools.count()
        self.reqs = itertools.count()
        self.lock_slots: dict[int, dict[int, int]] = {}
        self.pin_slots: dict[int, dict[int, int]] = {}

    def _host_evicted(self, keys: list[int]) -> None:
        dev, _ = self._tier_maps()
        assert not (set(keys) & set(dev)), "only host-only pages leave L2"
        self.l2.difference_update(keys)
        self.l2_dropped.update(keys)

    def _collect(self) -> None:
        for cmd in self.tree.drain():
            if isinstance(cmd, Backup):
                assert len(cmd.device_slots) == len(cmd.host_slots)
                self.backups.append(cmd)
            else:
                self.stores.append(cmd)

    def _reference(self, keys: list[int]) -> tuple[int, int]:
        d = 0
        while d < len(keys) and keys[d] in self.l1:
            d += 1
        h = d
        while h < len(keys) and keys[h] in self.l2:
            h += 1
        return d, h - d

    def _tier_maps(self) -> tuple[dict[int, int], dict[int, int]]:
        dev: dict[int, int] = {}
        host: dict[int, int] = {}
        for n in self.tree.nodes():
            if n.device is not None:
                dev.update(zip(n.keys, n.device, strict=True))
            if n.host is not None and not n.host_pending:
                host.update(zip(n.keys, n.host, strict=True))
        return dev, host

    @rule(seq=sequences)
    def insert(self, seq: tuple[int, ...]) -> None:
        keys = chain_keys(seq)
        owner = ("req", next(self.reqs))
        slots = self.dev.alloc(len(keys), owner)
        if slots is None:
            self.l2_dropped = set()
            ev = self.tree.evict_device(len(keys) - self.dev.num_free)
            self._apply_evict(ev)
            self._collect()
            slots = self.dev.alloc(len(keys), owner)
            if slots is None:
                return
        result = self.tree.insert(keys, slots, owner, next(self.clock))
        assert result.cached_pages + result.adopted_pages == len(keys)
        assert self.dev.owned_by(owner) == []
        self.l1.update(keys)
        self._collect()

    @rule(target=locks, seq=sequences, lock=st.booleans())
    def match_and_lock(self, seq: tuple[int, ...], lock: bool):
        keys = chain_keys(seq)
        expect = self._reference(keys)
        m = self.tree.match(keys, next(self.clock))
        self._collect()
        assert (m.device_pages, m.host_pages) == expect, (m, expect)
        assert m.query_pages == len(keys) and m.l3_start == sum(expect)
        dev, host = self._tier_maps()
        assert m.device_slots == [dev[k] for k in keys[: m.device_pages]]
        assert m.host_slots == [host[k] for k in keys[m.device_pages : m.l3_start]]
        if not lock:
            return multiple()
        receipt = self.tree.lock(m.device_node)
        self.lock_slots[receipt.serial] = {k: dev[k] for k in keys[: m.device_pages]}
        return receipt

    @rule(target=pins, seq=sequences)
    def match_and_pin(self, seq: tuple[int, ...]):
        keys = chain_keys(seq)
        m = self.tree.match(keys, next(self.clock))
        self._collect()
        _, host = self._tier_maps()
        if m.host_node is not self.tree.root and m.host_node.host is None:
            with pytest.raises(LockError):
                self.tree.pin_host(m.host_node)
            return multiple()
        pin = self.tree.pin_host(m.host_node)
        self.pin_slots[pin.serial] = {k: host[k] for k in keys[: m.l3_start] if k in host}
        return pin

    @rule(receipt=consumes(locks))
    def unlock(self, receipt) -> None:
        self.tree.unlock(receipt)
        del self.lock_slots[receipt.serial]

    @rule(pin=consumes(pins))
    def unpin(self, pin) -> None:
        self.tree.unpin_host(pin)
        del self.pin_slots[pin.serial]

    def _apply_evict(self, ev) -> None:
        for k in ev.demoted_keys:
            # Demoted pages keep a valid L2 copy, unless L2 itself evicted them later in the
            # same call (to make room for a write-back backup).
            assert k in self.l2 or k in self.l2_dropped, "a demoted page must have a valid L2 copy"
        self.l1.difference_update(ev.demoted_keys)
        self.l1.difference_update(ev.dropped_keys)

    @rule(pages=st.integers(1, 30))
    def evict_device(self, pages: int) -> None:
        before = self.dev.num_free
        self.l2_dropped = set()
        ev = self.tree.evict_device(pages)
        self._collect()
        assert self.dev.num_free - before == ev.freed
        assert ev.freed == len(ev.demoted_keys) + len(ev.dropped_keys)
        self._apply_evict(ev)

    @rule()
    def evict_device_one(self) -> None:
        """The node an eviction takes first is, of all nodes evictable from L1, the one with the
        smallest key under the tree's policy (a brute-force scan, not the tree's heap)."""
        tree = self.tree
        keyed = [(tree._priority(n), n) for n in tree.nodes() if tree._l1_evictable(n)]
        before = self.dev.num_free
        self.l2_dropped = set()
        ev = tree.evict_device(1)
        self._collect()
        assert self.dev.num_free - before == ev.freed
        self._apply_evict(ev)
        if not keyed:
            assert ev.freed == ev.pending == 0
            return
        taken = [(k, n) for k, n in keyed if n.device is None or n.evict_after_backup]
        assert len(taken) == 1, taken
        assert taken[0][0] == min(k for k, _ in keyed), (taken, keyed)

    @rule()
    def evict_host_one(self) -> None:
        """Likewise for L2: the evictable host-only leaf with the smallest key goes first."""
        tree = self.tree
        keyed = [(tree._priority(n), n) for n in tree.nodes() if tree._l2_evictable(n)]
        ev = tree.evict_host(1)
        taken = [(k, n) for k, n in keyed if n.parent is None]
        assert len(taken) == (1 if keyed else 0), (taken, keyed)
        if keyed:
            assert taken[0][0] == min(k for k, _ in keyed), (taken, keyed)
            assert ev.dropped_keys == list(taken[0][1].keys)

    @rule(pages=st.integers(1, 30))
    def evict_host(self, pages: int) -> None:
        before = self.host.num_free
        ev = self.tree.evict_host(pages)
        assert self.host.num_free - before == ev.freed == len(ev.dropped_keys)
        assert not (set(ev.dropped_keys) & self.l2), "the eviction hook saw every dropped page"

    @precondition(lambda self: self.backups)
    @rule(data=st.data())
    def backup_done(self, data) -> None:
        cmd = self.backups.pop(data.draw(st.integers(0, len(self.backups) - 1)))
        res = self.tree.backup_done(cmd.op)
        assert len(res.backed_keys) == len(cmd.host_slots)
        self.l2.update(res.backed_keys)
        self.l1.difference_update(res.demoted_keys)
        self._collect()

    @precondition(lambda self: self.stores)
    @rule(data=st.data())
    def store_done(self, data) -> None:
        cmd = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1)))
        assert sorted(self.tree.store_done(cmd.op)) == sorted(cmd.keys)

    @invariant()
    def invariants_hold(self) -> None:
        """Structure, agreement with the model, and locked/pinned slots untouched."""
        self.tree.check()
        dev, host = self._tier_maps()
        assert set(dev) == self.l1
        assert set(host) == self.l2
        for held in self.lock_slots.values():
            for k, s in held.items():
                assert dev.get(k) == s, "a locked page lost its L1 slot"
        for held in self.pin_slots.values():
            for k, s in held.items():
                assert host.get(k) == s, "a pinned page lost its L2 slot"

    def _finish_io(self) -> None:
        while self.backups or self.stores:
            for cmd in self.backups:
                res = self.tree.backup_done(cmd.op)
                self.l2.update(res.backed_keys)
                self.l1.difference_update(res.demoted_keys)
            for cmd in self.stores:
                self.tree.store_done(cmd.op)
            self.backups, self.stores = [], []
            self._collect()

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        for r in self.tree.live_locks:
            self.tree.unlock(r)
        for p in self.tree.live_pins:
            self.tree.unpin_host(p)
        # Finish all I/O, then everything must be evictable and every slot must come back.
        self._finish_io()
        # Under write_back each round frees one level of leaves (they back up first).
        for _ in range(100):
            if self.tree.num_nodes == 0:
                break
            self.l2_dropped = set()
            self._apply_evict(self.tree.evict_device(10**9))
            self._collect()
            self._finish_io()
            self.tree.evict_host(10**9)
        self.tree.check()
        assert self.tree.num_nodes == 0
        assert self.dev.num_free == self.dev.capacity
        assert self.host.num_free == self.host.capacity


TestTieredTree = pytest.mark.slow(TieredTreeMachine.TestCase)
TestTieredTree.settings = settings(
    max_examples=examples(300),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class _First:
    """Stands in for hypothesis' `data` in a replayed run: every draw takes the first choice."""

    def draw(self, strategy: object) -> int:
        return 0


def test_mru_a_use_on_l1_reorders_the_l2_queue() -> None:
    """Under `mru` a use lowers a node's key below the L2 entry it queued while on L1 and L2;
    once demoted to L2 only, it must leave L2 before a leaf with a higher key (a run the state
    machine found)."""
    m = TieredTreeMachine()
    m.setup(l1=2, l2=4, eviction="mru", write="write_through", store=True)
    steps = [
        ("insert", {"seq": (2, 2, 0, 0)}),
        ("backup_done", {"data": _First()}),
        ("store_done", {"data": _First()}),
        ("insert", {"seq": (1, 1, 0, 2)}),
        ("match_and_lock", {"lock": False, "seq": (2, 2)}),
        ("evict_host_one", {}),
        ("backup_done", {"data": _First()}),
        ("store_done", {"data": _First()}),
        ("insert", {"seq": (1, 1, 0, 2)}),
        ("evict_device_one", {}),
        ("evict_host_one", {}),
    ]
    for name, kwargs in steps:
        getattr(m, name)(**kwargs)
        m.invariants_hold()
    m.teardown()
