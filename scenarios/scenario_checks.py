"""Scenario values: the error every bad value becomes, and the checks of single values
(integers, numbers, names, paths, choices) that the scenario schema is built from.

A check takes a raw TOML value and returns it (or its normal form) or raises `_Invalid` with
what was expected; the schema adds the file and the dotted field (`scenario_schema.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hicache.core.settings import Setting


class ScenarioError(ValueError):
    """A scenario that cannot be loaded: `source` (file or `--set`), the dotted `field` (or None
    for the file as a whole) and `detail`, which names the bad value and what was expected."""

    def __init__(self, source: str, field: str | None, detail: str) -> None:
        self.source = source
        self.field = field
        self.detail = detail
        super().__init__(f"{source}: {field}: {detail}" if field else f"{source}: {detail}")


class _Invalid(Exception):
    """A value a check rejects; the caller adds the file and the field."""


# --- value checks ---------------------------------------------------------------------------

Check = Callable[[Any], Any]


SHOWN_CHARS = 80  # of a bad value in a message: a 100 MB value must not become a 100 MB message
NAME_CHARS = 256  # names title plots and name the default results folder
PATH_CHARS = 4096  # PATH_MAX on Linux


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


def _show(value: Any) -> str:
    return f"{_short(value)} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(low: int, high: int | None = None) -> Check:
    span = f">= {low}" if high is None else f"in {low}..{high}"

    def check(value: Any) -> int:
        if not _is_int(value):
            raise _Invalid(f"expected an integer {span}, got {_show(value)}")
        if value < low or (high is not None and value > high):
            raise _Invalid(f"expected an integer {span}, got {_short(value)}")
        return value

    return check


def _number(low: float, *, above: bool = False, high: float | None = None) -> Check:
    """A finite number >= low (> low when `above`), <= high when given; ints become floats."""
    span = ("> " if above else ">= ") + f"{low:g}" + (f" and <= {high:g}" if high is not None else "")

    def check(value: Any) -> float:
        if not _is_number(value):
            raise _Invalid(f"expected a number {span}, got {_show(value)}")
        try:
            as_float = float(value)
        except OverflowError:  # an int beyond any float
            as_float = math.inf
        ok = math.isfinite(as_float) and (as_float > low if above else as_float >= low)
        if not ok or (high is not None and as_float > high):
            raise _Invalid(f"expected a finite number {span}, got {_short(value)}")
        return as_float

    return check


def _bounded(value: str, limit: int) -> str:
    if len(value) > limit:
        raise _Invalid(f"expected at most {limit:,} characters, got a string of {len(value):,}")
    return value


def _text(value: Any, limit: int = NAME_CHARS) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"expected a non-empty string, got {_show(value)}")
    return _bounded(value, limit)


def _path(value: Any) -> str:
    return _text(value, PATH_CHARS)


def _any_text(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"expected a string, got {_show(value)}")
    return _bounded(value, NAME_CHARS)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {_show(value)}")
    return value


def _one_of(choices: Sequence[str], noun: str) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            shown = _short(value) if isinstance(value, str) else _show(value)
            raise _Invalid(f"unknown {noun} {shown}; expected one of: {', '.join(choices)}")
        return value

    return check


def _token_range(value: Any) -> tuple[int, int]:
    """A 2-element array [lo, hi] of integers with 1 <= lo <= hi (inclusive)."""
    if not isinstance(value, list | tuple) or len(value) != 2 or not all(_is_int(v) for v in value):
        raise _Invalid(f"expected a range [lo, hi] of two integers, got {_show(value)}")
    if not 1 <= value[0] <= value[1]:
        raise _Invalid(f"expected a range [lo, hi] with 1 <= lo <= hi, got {list(value)!r}")
    return (value[0], value[1])


def _distinct_names(choices: Sequence[str], noun: str) -> Check:
    def check(value: Any) -> tuple[str, ...]:
        if not isinstance(value, list | tuple) or not value:
            expected = f"expected a non-empty array of {noun}s from: {', '.join(choices)}"
            raise _Invalid(f"{expected}; got {_show(value)}")
        one = _one_of(choices, noun)
        names = tuple(one(v) for v in value)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise _Invalid(f"{noun} {repeated[0]!r} is listed more than once in {list(names)!r}")
        return names

    return check


def _check_of(setting: Setting) -> Check:
    """A setting's check, from what its description says it accepts."""
    if setting.choices is not None:
        return _one_of(setting.choices, "policy")
    if setting.kind is bool:
        return _boolean
    low = 0 if setting.low is None else setting.low
    return _integer(int(low)) if setting.kind is int else _number(low)
