"""Policies are enums, accepted by name where they come from a file or a flag."""

from __future__ import annotations

import enum
from typing import TypeVar

from hicache.core.errors import PolicyError

E = TypeVar("E", bound=enum.Enum)


def parse_policy(kind: type[E], value: object, what: str) -> E:
    """`value` as a member of `kind` (given as a member or by its name); otherwise a
    `PolicyError` that starts with `what` and lists the names known."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(str(p.value) for p in kind)
        raise PolicyError(f"{what} {value!r}; expected one of: {known}") from None
