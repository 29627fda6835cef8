"""The shared L3's compact key tables must answer exactly as the dict they replace: the same
hits, the same recency order, the same evictions, for any 64-bit key and across growth."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.sim.channel import Channel
from hicache.sim.keyset import KeySet, LruKeySet, as_keys
from hicache.sim.store import SharedStore

EXTREMES = [0, 1, 2, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1]
# A small pool makes repeats, refreshes and evictions common; the extremes are always in it.
KEYS = st.one_of(st.sampled_from(EXTREMES), st.integers(0, 40), st.integers(0, 2**64 - 1))
BATCH = st.lists(KEYS, max_size=80)


class DictStore:
    """The store as it was: a dict in insertion order is the recency order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0

    def prefix_hits(self, keys: list[int], start: int = 0) -> int:
        n = start
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return n - start

    def touch(self, keys: list[int]) -> None:
        if self.capacity:
            for k in keys:
                if k in self.keys:
                    self.keys.move_to_end(k)

    def add(self, keys: list[int]) -> None:
        for k in keys:
            self.keys.pop(k, None)
            self.keys[k] = None
        while self.capacity and len(self.keys) > self.capacity:
            self.keys.popitem(last=False)
            self.evicted += 1


class StoreAgainstDict(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store: SharedStore | None = None
        self.model: DictStore | None = None

    @precondition(lambda self: self.store is None)
    @rule(capacity=st.sampled_from([0, 0, 1, 3, 17, 100]))
    def start(self, capacity: int) -> None:
        self.store = SharedStore(Channel("L3", 1e9, 0.0), capacity)
        self.model = DictStore(capacity)

    @precondition(lambda self: self.store is not None)
    @rule(keys=BATCH)
    def add(self, keys: list[int]) -> None:
        self.store.add(keys)
        self.model.add(keys)

    @precondition(lambda self: self.store is not None)
    @rule(keys=BATCH)
    def touch(self, keys: list[int]) -> None:
        self.store.touch(keys)
        self.model.touch(keys)

    @precondition(lambda self: self.store is not None)
    @rule(keys=BATCH, start=st.integers(0, 90))
    def prefix_hits(self, keys: list[int], start: int) -> None:
        assert self.store.prefix_hits(keys, start) == self.model.prefix_hits(keys, start)

    @precondition(lambda self: self.store is not None and len(self.model.keys) > 0)
    @rule(data=st.data(), tail=BATCH)
    def prefix_of_held(self, data: st.DataObject, tail: list[int]) -> None:
        """Long runs of hits, past the first chunk a query converts."""
        held = list(self.model.keys)
        keys = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=200)) + tail
        assert self.store.prefix_hits(keys) == self.model.prefix_hits(keys)

    @precondition(lambda self: self.store is not None)
    @invariant()
    def same_state(self) -> None:
        assert len(self.store) == len(self.model.keys)
        assert self.store.evicted == self.model.evicted
        for k in EXTREMES:
            assert (k in self.store) == (k in self.model.keys)
        table = self.store._keys
        if isinstance(table, LruKeySet):
            assert table.order() == list(self.model.keys)  # eviction order: least recent first


TestStoreAgainstDict = pytest.mark.slow(StoreAgainstDict.TestCase)
TestStoreAgainstDict.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.slow
def test_growth_across_resizes_keeps_every_key() -> None:
    rng = random.Random(3)
    keys = EXTREMES + [rng.getrandbits(64) for _ in range(60_000)]
    absent = [rng.getrandbits(64) for _ in range(2_000)]
    absent = [k for k in absent if k not in set(keys)]
    plain, lru = KeySet(), LruKeySet(capacity=len(keys) + 10)
    sizes = set()
    for i in range(0, len(keys), 997):  # batches that straddle every doubling
        batch = as_keys(keys[i : i + 997])
        plain.add(batch)
        lru.add(batch)
        sizes.add(plain.nbytes)
        assert plain.prefix(as_keys(keys[: i + batch.size])) == i + batch.size
    assert len(sizes) > 5  # the table doubled several times
    for table in (plain, lru):
        assert len(table) == len(set(keys))
        assert table.prefix(as_keys(keys)) == len(keys)
        assert not any(k in table for k in absent)
    assert lru.order() == list(dict.fromkeys(keys))
    assert lru.evicted == 0
    # About 8 bytes a slot at most 3/4 full: 11-21 bytes a key.
    assert plain.nbytes <= 22 * len(plain)


def test_a_bounded_table_evicts_through_its_regrowth() -> None:
    """Evictions free entries that later keys reuse; the table stays near its capacity."""
    rng = random.Random(5)
    lru, model = LruKeySet(capacity=500), DictStore(500)
    for _ in range(300):
        batch = [rng.getrandbits(64) if rng.random() < 0.7 else rng.randrange(600) for _ in range(40)]
        lru.add(as_keys(batch))
        model.add(batch)
        touched = [rng.randrange(600) for _ in range(10)]
        lru.touch(as_keys(touched))
        model.touch(touched)
    assert lru.order() == list(model.keys)
    assert lru.evicted == model.evicted > 0
    assert lru.nbytes < 64 * 1024


def test_keys_outside_64_bits_are_refused() -> None:
    store = SharedStore(Channel("L3", 1e9, 0.0))
    with pytest.raises(OverflowError):
        store.add([2**64])
    with pytest.raises(OverflowError):
        store.add([-1])
    assert len(store) == 0
    with pytest.raises(ValueError, match="capacity"):
        LruKeySet(0)


def test_numpy_and_iterator_batches() -> None:
    store = SharedStore(Channel("L3", 1e9, 0.0), capacity_pages=4)
    store.add(np.array([5, 6, 7], dtype=np.uint64))
    store.add(k for k in (8, 9))
    assert store.prefix_hits([6, 7, 8, 9, 5]) == 4 and store.evicted == 1
