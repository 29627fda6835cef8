"""The prefill scheduler's invariants, driven by hypothesis through every order of events a
prefill node can feed it: prompts arriving, admitted, started, stepped, cancelled anywhere,
released."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.core.prefill_sched import Chunk, Phase, PrefillScheduler, Refused, SchedulerError

PAGE = 16
CAPACITY = 12


class SchedulerMachine(RuleBasedStateMachine):
    """A driver that computes every step it is given, and a record of what each prompt saw."""

    def __init__(self) -> None:
        super().__init__()
        self.s = PrefillScheduler(CAPACITY, PAGE, chunk_tokens=64, step_tokens=96, starve_steps=2)
        self.next_key = 0
        self.arrived: set[str] = set()
        self.ended: list[str] = []  # each prompt once, by release or a cancel while waiting
        self.cancelled: set[str] = set()
        self.in_step: list[Chunk] = []  # handed out, not yet reported computed
        self.passed_over: dict[str, int] = {}

    @rule(pages=st.integers(0, CAPACITY + 2))
    def arrive(self, pages: int) -> None:
        key = f"r{self.next_key}"
        self.next_key += 1
        if pages > CAPACITY:
            with pytest.raises(Refused):
                self.s.arrive(key, pages)
            assert key not in self.s.jobs  # refused at once: nothing to end later
            return
        self.s.arrive(key, pages)
        self.arrived.add(key)

    @rule()
    def admit(self) -> None:
        before = list(self.s.queue)
        admitted = [j.key for j in self.s.admit()]
        assert admitted == before[: len(admitted)]  # FIFO, no overtaking

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        admitted = sorted(k for k, j in self.s.jobs.items() if j.phase is Phase.ADMITTED)
        if not admitted:
            return
        key = data.draw(st.sampled_from(admitted))
        n = data.draw(st.integers(1, 400))
        lo = data.draw(st.sampled_from(sorted({0, (n - 1) // PAGE * PAGE, n - 1})))
        self.s.start(key, lo, n)

    @precondition(lambda self: not self.in_step)
    @rule()
    def step(self) -> None:
        could = {k for k, j in self.s.jobs.items() if j.phase is Phase.RUNNING and j.remaining > 0}
        chunks = self.s.step()
        keys = [c.key for c in chunks]
        assert len(keys) == len(set(keys)), "two chunks of one prompt in a step"
        assert sum(c.hi - c.lo for c in chunks) <= self.s.step_tokens
        assert bool(chunks) == bool(could), "running work left without a step"
        for c in chunks:
            job = self.s.jobs[c.key]
            assert c.key not in self.cancelled, "cancelled work resumed"
            assert c.lo == job.done and c.hi <= job.end and c.hi - c.lo <= self.s.chunk_tokens
            assert c.last == (c.hi == job.end)
            if not c.last:
                assert c.hi % PAGE == 0, "a chunk that stops early ends mid-page"
        for k in could:
            self.passed_over[k] = 0 if k in keys else self.passed_over.get(k, 0) + 1
            # Starvation bound: passed over at most starve_steps steps, plus one per other
            # starved prompt ahead of it (each takes a chunk first).
            assert self.passed_over[k] <= self.s.starve_steps + len(could)
        self.in_step = chunks

    @precondition(lambda self: bool(self.in_step))
    @rule()
    def computed(self) -> None:
        for c in self.in_step:
            self.s.computed(c)
        self.in_step = []

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = sorted(self.arrived - set(self.ended))
        if not live:
            return
        key = data.draw(st.sampled_from(live))
        waiting = self.s.phase(key) is Phase.WAITING
        self.s.cancel(key)
        self.cancelled.add(key)
        if waiting:
            self.ended.append(key)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        done = sorted(
            k for k, j in self.s.jobs.items() if j.phase in (Phase.COMPUTED, Phase.CANCELLED, Phase.ADMITTED)
        )
        if not done:
            return
        key = data.draw(st.sampled_from(done))
        self.s.release(key)
        self.ended.append(key)
        with pytest.raises(SchedulerError):
            self.s.release(key)  # a second end is refused, by name

    @invariant()
    def pages_and_ends(self) -> None:
        self.s.check()  # every staging page free or held by exactly one prompt
        assert len(self.ended) == len(set(self.ended)), "a prompt ended twice"
        assert set(self.s.jobs) | set(self.ended) == self.arrived
        assert not set(self.s.jobs) & set(self.ended)
        assert self.s.ended == len(self.ended)

    def teardown(self) -> None:
        # Drain: everything left ends, and every page comes back.
        for c in self.in_step:
            self.s.computed(c)
        for key in list(self.s.jobs):
            if self.s.phase(key) is Phase.WAITING:
                self.s.cancel(key)
            else:
                self.s.release(key)
        assert sorted(self.s.free) == list(range(CAPACITY))
        assert not self.s.jobs and not self.s.queue


TestScheduler = SchedulerMachine.TestCase


@given(long=st.integers(2000, 8000), smalls=st.lists(st.integers(1, 300), min_size=1, max_size=12))
def test_a_short_prompt_waits_at_most_one_chunk_of_a_long_one(long: int, smalls: list[int]) -> None:
    """Short prompts arriving one per step while a long one runs: each is computed in the step
    after it arrived, beside at most one chunk of the long prompt (shortest work first), and
    the long one still advances (a starved prompt goes first)."""
    s = PrefillScheduler(4096, PAGE, chunk_tokens=512, step_tokens=1024)
    s.arrive("long", 1)
    s.admit()
    s.start("long", 0, long)
    long_chunks_while = {}
    for i, n in enumerate(smalls):
        key = f"s{i}"
        s.arrive(key, 1)
        s.admit()
        s.start(key, 0, n)
        chunks = s.step()
        assert any(c.key == key and c.last for c in chunks), chunks
        long_chunks_while[key] = sum(c.key == "long" for c in chunks)
        for c in chunks:
            s.computed(c)
    assert all(v <= 1 for v in long_chunks_while.values())
    while s.busy():
        for c in s.step():
            s.computed(c)
    assert s.phase("long") is Phase.COMPUTED
