"""argparse `type`s that say what they expected: a bad value exits with one line naming the flag
and the accepted range, not a traceback."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (no upper bound when `high` is None)."""
    want = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < low or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    return parse


def float_above(low: float, *, inclusive: bool = False) -> Callable[[str], float]:
    """A finite number > low (>= low when `inclusive`)."""
    want = f"a finite number {'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if not math.isfinite(value) or value < low or value == low and not inclusive:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    return parse


def directory(text: str) -> Path:
    """A folder, created later where it does not exist yet; never a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a directory, got {text!r}, which exists and is not one")
    return path
