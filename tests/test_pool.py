"""Example-based tests of SlotPool: allocation, ownership, and its own consistency check."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from builders import examples
from hypothesis import given, settings

from hicache.core.errors import CoreError, PoolError
from hicache.core.pool import SlotPool


def make_pool(capacity: int = 8, name: str = "L1") -> SlotPool:
    pool = SlotPool(name, capacity)
    pool.check()
    return pool


def test_new_pool_is_all_free() -> None:
    pool = make_pool(4)
    assert pool.capacity == 4
    assert pool.num_free == 4
    assert pool.num_used == 0
    assert sorted(pool.free_slots()) == [0, 1, 2, 3]
    assert [pool.owner_of(s) for s in range(4)] == [None] * 4


def test_alloc_returns_distinct_low_slots_and_records_the_owner() -> None:
    pool = make_pool(8)
    a = pool.alloc(3, "a")
    b = pool.alloc(2, "b")
    assert a == [0, 1, 2]
    assert b == [3, 4]
    assert pool.num_free == 3
    assert pool.num_used == 5
    assert pool.owned_by("a") == [0, 1, 2]
    assert pool.owned_by("b") == [3, 4]
    assert pool.owner_of(4) == "b"
    assert pool.owner_of(5) is None
    pool.check()


def test_alloc_zero_returns_empty_list() -> None:
    pool = make_pool(2)
    assert pool.alloc(0, "a") == []
    assert pool.num_free == 2


def test_alloc_when_short_returns_none_and_takes_nothing() -> None:
    pool = make_pool(4)
    assert pool.alloc(3, "a") == [0, 1, 2]
    before = pool.free_slots()
    assert pool.alloc(2, "b") is None
    assert pool.num_free == 1
    assert pool.free_slots() == before
    assert pool.owned_by("b") == []
    # What is left can still be taken exactly.
    assert pool.alloc(1, "b") == [3]
    assert pool.alloc(1, "b") is None
    pool.check()


def test_alloc_rejects_negative_count_and_missing_owner() -> None:
    pool = make_pool(4)
    with pytest.raises(PoolError, match=r"L1 pool: cannot allocate -1 slots"):
        pool.alloc(-1, "a")
    with pytest.raises(PoolError, match=r"L1 pool: an allocation needs an owner"):
        pool.alloc(1, None)
    assert pool.num_free == 4


def test_free_returns_slots_for_reuse() -> None:
    pool = make_pool(4)
    slots = pool.alloc(4, "a")
    assert slots == [0, 1, 2, 3]
    pool.free([1, 3], "a")
    assert pool.num_free == 2
    assert pool.owner_of(1) is None
    assert pool.owned_by("a") == [0, 2]
    assert pool.alloc(2, "b") == [1, 3]
    pool.check()


def test_free_by_wrong_owner_names_slot_and_actual_owner_and_frees_nothing() -> None:
    pool = make_pool(4)
    pool.alloc(2, "a")  # [0, 1]
    pool.alloc(1, "b")  # [2]
    with pytest.raises(PoolError) as err:
        pool.free([0, 2], "a")
    assert str(err.value) == "L1 pool: free of slot 2 by 'a', but it is owned by 'b'"
    # All slots are checked before any is freed.
    assert pool.owner_of(0) == "a"
    assert pool.owner_of(2) == "b"
    assert pool.num_free == 1
    pool.check()


def test_pool_error_is_a_core_error() -> None:
    assert issubclass(PoolError, CoreError)


def test_double_free_raises_and_pool_stays_consistent() -> None:
    pool = make_pool(4)
    slots = pool.alloc(2, "a")
    assert slots is not None
    pool.free(slots, "a")
    with pytest.raises(PoolError) as err:
        pool.free(slots, "a")
    assert str(err.value) == "L1 pool: free of slot 0 by 'a', but it is free"
    assert pool.num_free == 4
    assert sorted(pool.free_slots()) == [0, 1, 2, 3]
    pool.check()


def test_free_naming_a_slot_twice_raises() -> None:
    pool = make_pool(4)
    pool.alloc(2, "a")
    with pytest.raises(PoolError, match=r"^L1 pool: free names slot 1 twice$"):
        pool.free([1, 1], "a")
    assert pool.owned_by("a") == [0, 1]
    pool.check()


@pytest.mark.parametrize("slot", [-1, 4, 100])
def test_slot_out_of_range(slot: int) -> None:
    pool = make_pool(4)
    pool.alloc(4, "a")
    with pytest.raises(PoolError) as err:
        pool.free([slot], "a")
    assert str(err.value) == f"L1 pool: free of slot {slot} outside 0..3"
    with pytest.raises(PoolError, match=rf"L1 pool: transfer of slot {slot} outside 0\.\.3"):
        pool.transfer([slot], "a", "b")
    assert pool.owned_by("a") == [0, 1, 2, 3]


def test_transfer_moves_ownership() -> None:
    pool = make_pool(4)
    pool.alloc(3, "req")
    pool.transfer([0, 2], "req", "tree")
    assert pool.owned_by("req") == [1]
    assert pool.owned_by("tree") == [0, 2]
    assert pool.num_free == 1
    pool.check()


def test_transfer_enforces_the_source_owner() -> None:
    pool = make_pool(4, name="L2")
    pool.alloc(1, "a")  # [0]
    pool.alloc(1, "b")  # [1]
    with pytest.raises(PoolError) as err:
        pool.transfer([0, 1], "a", "c")
    assert str(err.value) == "L2 pool: transfer of slot 1 by 'a', but it is owned by 'b'"
    with pytest.raises(PoolError) as err:
        pool.transfer([3], "a", "c")
    assert str(err.value) == "L2 pool: transfer of slot 3 by 'a', but it is free"
    # Nothing moved, not even the slot that was checked first.
    assert pool.owner_of(0) == "a"
    assert pool.owner_of(1) == "b"
    assert pool.owned_by("c") == []


def test_transfer_needs_a_destination() -> None:
    pool = make_pool(2)
    pool.alloc(1, "a")
    with pytest.raises(PoolError, match=r"L1 pool: transfer needs a destination owner"):
        pool.transfer([0], "a", None)
    assert pool.owner_of(0) == "a"


def test_owners_compare_by_equality() -> None:
    pool = make_pool(2)
    pool.alloc(1, ("req", 7))
    pool.free([0], ("req", 7))
    assert pool.num_free == 2


def test_check_detects_duplicate_on_free_list() -> None:
    pool = make_pool(4)
    pool.alloc(1, "a")
    pool._free.append(pool._free[0])  # corrupt: a slot listed free twice
    with pytest.raises(PoolError, match=r"^L1 pool: a slot is on the free list twice$"):
        pool.check()


def test_check_detects_free_slot_that_is_owned() -> None:
    pool = make_pool(4)
    pool.alloc(1, "a")  # slot 0
    pool._free.append(0)
    pool._free.remove(1)
    pool._owner[1] = "ghost"
    with pytest.raises(PoolError, match=r"^L1 pool: slot 0 is free and owned by 'a'$"):
        pool.check()


def test_check_detects_lost_slot() -> None:
    pool = make_pool(4)
    pool._free.remove(2)  # neither free nor owned
    with pytest.raises(PoolError, match=r"^L1 pool: 1 slots are neither free nor owned$"):
        pool.check()


def test_capacity_zero() -> None:
    pool = make_pool(0)
    assert pool.num_free == 0
    assert pool.num_used == 0
    assert pool.alloc(0, "a") == []
    assert pool.alloc(1, "a") is None
    with pytest.raises(PoolError, match=r"L1 pool: free of slot 0 outside"):
        pool.free([0], "a")
    pool.check()


@pytest.mark.parametrize("capacity", [-1, -100])
def test_negative_capacity_raises_value_error_naming_the_pool(capacity: int) -> None:
    with pytest.raises(ValueError) as err:
        SlotPool("host-L2", capacity)
    assert "host-L2 pool" in str(err.value)
    assert repr(capacity) in str(err.value)


def test_non_integer_capacity_raises_value_error() -> None:
    with pytest.raises(ValueError, match=r"^L1 pool: capacity must be an integer >= 0 pages, got 2\.5$"):
        SlotPool("L1", 2.5)  # type: ignore[arg-type]


def test_boolean_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity must be an integer"):
        SlotPool("L1", True)  # type: ignore[arg-type]


def test_transfer_accepts_an_iterator() -> None:
    pool = make_pool(4)
    pool.alloc(2, "req")
    pool.transfer(iter([0, 1]), "req", "tree")
    assert pool.owned_by("tree") == [0, 1]
    pool.check()


# ------------------------------------------------------------------ batches: runs and single slots
#
# free, transfer and adopt check and move long batches run by run (slices) and short or
# fragmented ones slot by slot. Either way a batch is all or nothing.

CAP = 200


def _batch(draw: st.DrawFn, pool: SlotPool, owner: str) -> list[int]:
    """Some of `owner`'s slots, as runs or scattered, sometimes spoiled by one bad slot."""
    mine = pool.owned_by(owner)
    kind = draw(st.sampled_from(["runs", "scattered", "empty"]))
    if kind == "empty" or not mine:
        batch: list[int] = []
    elif kind == "runs":
        start = draw(st.integers(0, len(mine) - 1))
        batch = mine[start : start + draw(st.integers(1, len(mine)))]
        cut = draw(st.integers(0, len(batch)))
        batch = batch[cut:] + batch[:cut]  # two runs, the later one first
    else:
        batch = draw(st.lists(st.sampled_from(mine), unique=True, max_size=len(mine)))
    bad = draw(st.sampled_from(["none", "none", "repeat", "foreign", "free", "past_end", "negative"]))
    spot = draw(st.integers(0, len(batch)))
    if bad == "repeat" and batch:
        batch.insert(spot, batch[draw(st.integers(0, len(batch) - 1))])
    elif bad == "foreign" and pool.owned_by("other"):
        batch.insert(spot, draw(st.sampled_from(pool.owned_by("other"))))
    elif bad == "free" and pool.free_slots():
        batch.insert(spot, draw(st.sampled_from(pool.free_slots())))
    elif bad == "past_end":
        batch.insert(spot, CAP + draw(st.integers(0, 5)))
    elif bad == "negative":
        batch.insert(spot, -draw(st.integers(1, CAP)))
    return batch


def _valid(pool_owners: list[object], batch: list[int], owner: str) -> bool:
    return len(set(batch)) == len(batch) and all(0 <= s < CAP and pool_owners[s] == owner for s in batch)


@st.composite
def _pool_and_batches(draw: st.DrawFn) -> tuple[SlotPool, list[int], list[int]]:
    pool = SlotPool("L1", CAP)
    for _ in range(draw(st.integers(1, 6))):  # interleaved allocations fragment the free list
        who = draw(st.sampled_from(["req", "req", "other"]))
        got = pool.alloc(draw(st.integers(1, 60)), who)
        if got and draw(st.booleans()):
            pool.free(got[: draw(st.integers(0, len(got)))], who)
    return pool, _batch(draw, pool, "req"), _batch(draw, pool, "req")


@settings(max_examples=examples(400), deadline=None)
@given(_pool_and_batches(), st.sampled_from(["free", "transfer", "adopt"]))
def test_a_batch_moves_whole_or_not_at_all(case: tuple[SlotPool, list[int], list[int]], op: str) -> None:
    pool, batch, other = case
    owners = [pool.owner_of(s) for s in range(CAP)]
    free_before = pool.free_slots()
    if op == "adopt":
        ok = _valid(owners, batch + other, "req")
        assert pool.adopt(batch, other, "req", "tree") is ok
    else:
        ok = _valid(owners, batch, "req")
        try:
            if op == "free":
                pool.free(batch, "req")
            else:
                pool.transfer(batch, "req", "tree")
        except PoolError:
            assert not ok
        else:
            assert ok
    if not ok:
        assert [pool.owner_of(s) for s in range(CAP)] == owners
        assert pool.free_slots() == free_before
    else:
        moved, released = {"adopt": (batch, other), "transfer": (batch, []), "free": ([], batch)}[op]
        for s in moved:
            assert pool.owner_of(s) == "tree"
        for s in released:
            assert pool.owner_of(s) is None
        assert pool.free_slots() == free_before + released[::-1]
        untouched = set(range(CAP)) - set(moved) - set(released)
        assert all(pool.owner_of(s) == owners[s] for s in untouched)
    pool.check()


@pytest.mark.parametrize(
    "case", ["overlapping_runs", "run_into_foreign", "run_into_free", "past_the_end", "across_batches"]
)
def test_a_long_batch_with_a_bad_run_changes_nothing(case: str) -> None:
    pool = SlotPool("L1", 160)
    mine = pool.alloc(96, "req")  # 0..95
    pool.alloc(32, "other")  # 96..127, and 128..159 stay free
    assert mine == list(range(96))
    batch, release = {
        "overlapping_runs": (list(range(64)) + list(range(32, 64)), []),
        "run_into_foreign": (list(range(32, 128)), []),
        "run_into_free": (list(range(128, 160)) + list(range(32)), []),
        "past_the_end": (list(range(64, 96)) + list(range(150, 170)), []),
        "across_batches": (list(range(48)), list(range(40, 96))),
    }[case]
    owners = [pool.owner_of(s) for s in range(160)]
    free_before = pool.free_slots()
    assert not pool.adopt(batch, release, "req", "tree")
    with pytest.raises(PoolError):
        pool.transfer(batch + release, "req", "tree")
    with pytest.raises(PoolError):
        pool.free(batch + release, "req")
    assert [pool.owner_of(s) for s in range(160)] == owners
    assert pool.free_slots() == free_before
    pool.check()
    # The same batches without the bad part move as a whole.
    assert pool.adopt(list(range(48)), list(range(48, 96)), "req", "tree")
    assert pool.owned_by("tree") == list(range(48)) and pool.owned_by("req") == []
    pool.check()
