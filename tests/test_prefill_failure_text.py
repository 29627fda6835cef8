"""A prefill failure reaches the decode node (and so the client) as one plain sentence: the
first leaf exception's type and message, never a trio group's "... (1 sub-exception)"."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from hicache.runtime.prefill.prefill_node import plain


def _nest(exc: BaseException, depth: int) -> BaseException:
    for i in range(depth):
        exc = ExceptionGroup(f"Exceptions from Trio nursery (level {i})", [exc])
    return exc


@given(st.integers(0, 5), st.text(min_size=1, max_size=40).filter(lambda s: "\n" not in s))
def test_a_failure_inside_nurseries_is_one_sentence_naming_the_leaf(depth: int, message: str) -> None:
    text = plain(_nest(RuntimeError(message), depth))
    assert text.startswith("RuntimeError: ")
    assert "sub-exception" not in text and "nursery" not in text.replace(message, "")


def test_the_first_of_several_failures_is_told() -> None:
    group = ExceptionGroup("two", [OSError("disk gone"), ValueError("second")])
    assert plain(ExceptionGroup("outer", [group])) == "OSError: disk gone"
