"""The base of the core's small result values: equal when their fields are, shown by them.

Those values are plain classes rather than attrs so that the compiled build constructs them
natively (an attrs-generated `__init__` stays interpreted, and a replay makes one per insert,
eviction, backup and account). They never change once made.
"""

from __future__ import annotations


class Value:
    """A value made of `fields()`: compared, hashed and shown by them."""

    __slots__ = ()

    def fields(self) -> tuple[tuple[str, object], ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Value)
        return self.fields() == other.fields()

    def __hash__(self) -> int:
        return hash(self.fields())

    def __repr__(self) -> str:
        return type(self).__name__ + "(" + ", ".join(f"{k}={v!r}" for k, v in self.fields()) + ")"
