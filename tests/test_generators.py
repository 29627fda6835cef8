"""The agentic and shared-prefix generators: deterministic, growing context, shared prompts."""

from __future__ import annotations

from collections import defaultdict

import hypothesis.strategies as st
import numpy as np
import pytest
from builders import examples
from hypothesis import given, settings

from hicache.scenarios.generators import AgenticLoop, SharedPrefix
from hicache.scenarios.multiturn import ChatRequest


def spans(low: int = 1, high: int = 40) -> st.SearchStrategy[tuple[int, int]]:
    return st.tuples(st.integers(low, high), st.integers(low, high)).map(lambda t: (min(t), max(t)))


agentic_loops = st.builds(
    AgenticLoop,
    sessions=st.integers(1, 5),
    steps=st.integers(1, 6),
    system_prompt=st.integers(0, 50),
    task_tokens=spans(),
    tool_output_tokens=spans(),
    output_tokens=spans(),
    rate=st.floats(0.1, 10.0),
    tool_time=st.sampled_from([0.0, 0.5, 3.0]),
    vocab=st.integers(2, 1000),
    seed=st.integers(0, 2**32),
)
shared_prefixes = st.builds(
    SharedPrefix,
    groups=st.integers(1, 5),
    prompts_per_group=st.integers(1, 6),
    system_prompt=st.integers(0, 50),
    question_tokens=spans(),
    output_tokens=spans(),
    rate=st.floats(0.1, 20.0),
    vocab=st.integers(2, 1000),
    seed=st.integers(0, 2**32),
)


def by_session(requests: list[ChatRequest]) -> dict[int, list[ChatRequest]]:
    out: dict[int, list[ChatRequest]] = defaultdict(list)
    for r in requests:
        out[r.conversation].append(r)
    return {c: sorted(rs, key=lambda r: r.turn) for c, rs in out.items()}


def fingerprint(requests: list[ChatRequest]) -> list[tuple]:
    return [(r.conversation, r.turn, r.arrival, r.prompt.tobytes(), r.output.tobytes()) for r in requests]


def assert_sorted(requests: list[ChatRequest]) -> None:
    keys = [(r.arrival, r.conversation, r.turn) for r in requests]
    assert keys == sorted(keys)


def in_span(n: int, span: tuple[int, int]) -> bool:
    return span[0] <= n <= span[1]


@settings(max_examples=examples(60), deadline=None)
@given(agentic_loops)
def test_agentic_steps_grow_the_session_context(gen: AgenticLoop) -> None:
    requests = gen.generate()
    assert_sorted(requests)
    assert all(r.prompt.dtype == np.int32 and r.output.dtype == np.int32 for r in requests)
    sessions = by_session(requests)
    assert sorted(sessions) == list(range(gen.sessions))
    system = requests[0].prompt[: gen.system_prompt]
    for steps in sessions.values():
        assert [r.turn for r in steps] == list(range(gen.steps))
        first = steps[0]
        # Every session opens with the one system prompt, then its task.
        assert np.array_equal(first.prompt[: gen.system_prompt], system)
        assert in_span(len(first.prompt) - gen.system_prompt, gen.task_tokens)
        for prev, step in zip(steps, steps[1:], strict=False):
            history = np.concatenate([prev.prompt, prev.output])
            assert np.array_equal(step.prompt[: len(history)], history)
            assert in_span(len(step.prompt) - len(history), gen.tool_output_tokens)
            assert step.arrival >= prev.arrival
            if gen.tool_time == 0:
                assert step.arrival == prev.arrival
        for r in steps:
            assert in_span(len(r.output), gen.output_tokens)
            assert int(r.prompt.max(initial=0)) < gen.vocab and int(r.prompt.min(initial=0)) >= 0


@settings(max_examples=examples(60), deadline=None)
@given(shared_prefixes)
def test_shared_prefix_groups_share_only_their_system_prompt(gen: SharedPrefix) -> None:
    requests = gen.generate()
    assert_sorted(requests)
    groups = by_session(requests)
    assert sorted(groups) == list(range(gen.groups))
    for prompts in groups.values():
        assert [r.turn for r in prompts] == list(range(gen.prompts_per_group))
        system = prompts[0].prompt[: gen.system_prompt]
        for r in prompts:
            assert np.array_equal(r.prompt[: gen.system_prompt], system)
            assert in_span(len(r.prompt) - gen.system_prompt, gen.question_tokens)
            assert in_span(len(r.output), gen.output_tokens)
    # One request per arrival: every arrival time is its own Poisson point.
    assert len({r.arrival for r in requests}) == len(requests)


def test_groups_have_different_system_prompts_and_interleave() -> None:
    gen = SharedPrefix(groups=8, prompts_per_group=8, system_prompt=256)
    requests = gen.generate()
    systems = {r.prompt[:256].tobytes() for r in requests}
    assert len(systems) == 8
    # A random interleaving, not group after group.
    order = [r.conversation for r in requests]
    assert order != sorted(order)


def test_agentic_sessions_share_the_system_prompt_and_differ_after_it() -> None:
    requests = AgenticLoop(sessions=6, steps=2, system_prompt=512).generate()
    firsts = [r for r in requests if r.turn == 0]
    assert len({r.prompt[:512].tobytes() for r in firsts}) == 1
    assert len({r.prompt[512:].tobytes() for r in firsts}) == 6


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: AgenticLoop(sessions=4, steps=3, seed=seed),
        lambda seed: SharedPrefix(groups=3, prompts_per_group=4, seed=seed),
    ],
)
def test_same_seed_same_tokens_other_seed_other_tokens(make) -> None:
    assert fingerprint(make(7).generate()) == fingerprint(make(7).generate())
    assert fingerprint(make(7).generate()) != fingerprint(make(8).generate())


def test_defaults_give_the_documented_sizes() -> None:
    agentic = AgenticLoop().generate()
    assert len(agentic) == 50 * 10
    shared = SharedPrefix().generate()
    assert len(shared) == 64 * 16


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (AgenticLoop, {"sessions": 0}, "sessions"),
        (AgenticLoop, {"steps": 1.5}, "steps"),
        (AgenticLoop, {"system_prompt": -1}, "system_prompt"),
        (AgenticLoop, {"task_tokens": (10, 5)}, "task_tokens"),
        (AgenticLoop, {"tool_output_tokens": (0, 5)}, "tool_output_tokens"),
        (AgenticLoop, {"output_tokens": (1, 2, 3)}, "output_tokens"),
        (AgenticLoop, {"rate": 0.0}, "rate"),
        (AgenticLoop, {"tool_time": -1.0}, "tool_time"),
        (AgenticLoop, {"tool_time": float("nan")}, "tool_time"),
        (AgenticLoop, {"vocab": 1}, "vocab"),
        (AgenticLoop, {"vocab": 2**31 + 1}, "vocab"),
        (AgenticLoop, {"seed": -1}, "seed"),
        (SharedPrefix, {"groups": 0}, "groups"),
        (SharedPrefix, {"prompts_per_group": True}, "prompts_per_group"),
        (SharedPrefix, {"question_tokens": (3, 2)}, "question_tokens"),
        (SharedPrefix, {"output_tokens": "64"}, "output_tokens"),
        (SharedPrefix, {"rate": float("inf")}, "rate"),
        (SharedPrefix, {"rate": 10**400}, "rate"),
        (SharedPrefix, {"system_prompt": -5}, "system_prompt"),
    ],
)
def test_bad_parameters_are_named(cls: type, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"workload: {name} must be"):
        cls(**kwargs)
