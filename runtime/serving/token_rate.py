"""Each caller's tokens per minute: a token bucket per caller (its API key's tenant, else the
caller an open door tells apart, auth.py), as OpenAI's TPM limits work. A request is charged its
prompt and the output it may generate when it arrives, and given back the output it did not
generate when it ends; a request that finds too few tokens gets a 429 with the seconds until
there are enough in Retry-After. A request larger than a whole minute's worth is charged a
minute's worth: it waits for a full bucket rather than never passing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import attrs

from hicache.runtime.serving.errors import ApiError

MAX_CALLERS = 100_000  # buckets kept; full ones (callers at rest) are dropped first


class RateLimited(ApiError):
    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(429, message, type="rate_limit_error", code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(retry_after_s)}


@attrs.define
class _Bucket:
    level: float
    at: float


class TokenRate:
    """`per_minute` tokens per caller per minute; `clock` is time.monotonic (a test's own)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        if per_minute < 1:
            raise ValueError(f"token rate: expected at least 1 token per minute, got {per_minute}")
        self.per_minute = per_minute
        self.per_s = per_minute / 60.0
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self.refused = 0

    def level(self, caller: str) -> float:
        """The tokens `caller` may spend now."""
        b = self._buckets.get(caller)
        if b is None:
            return float(self.per_minute)
        return min(float(self.per_minute), b.level + (self._clock() - b.at) * self.per_s)

    def charge(self, caller: str, tokens: int) -> int:
        """Take `tokens` (at most a minute's worth) from `caller`'s bucket, or raise
        `RateLimited`; returns what was taken, for `refund`."""
        need = min(max(0, tokens), self.per_minute)
        have = self.level(caller)
        if have < need:
            self.refused += 1
            wait = math.ceil((need - have) / self.per_s)
            raise RateLimited(
                f"this caller is limited to {self.per_minute} tokens a minute "
                f"(--max-tokens-per-minute-per-tenant) and this request needs {need}: retry in {wait} s",
                max(1, wait),
            )
        self._set(caller, have - need)
        return need

    def refund(self, caller: str, tokens: int) -> None:
        """Give back tokens charged but not used (output not generated)."""
        if tokens > 0:
            self._set(caller, min(float(self.per_minute), self.level(caller) + tokens))

    def _set(self, caller: str, level: float) -> None:
        if caller not in self._buckets and len(self._buckets) >= MAX_CALLERS:
            self._forget_full()
        self._buckets[caller] = _Bucket(level, self._clock())

    def _forget_full(self) -> None:
        full = [c for c in self._buckets if self.level(c) >= self.per_minute]
        for c in full or list(self._buckets)[: len(self._buckets) // 2]:
            del self._buckets[c]
