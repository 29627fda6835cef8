"""Builders shared by the tests: decode-node configs and prompts.

`decode_config` starts from a small node (pages of 4 tokens, a one-page decode reserve, L3
prefetched from two pages on) that every core test can shrink or grow by keyword;
`prompt(seed, n)` gives `n` tokens that no other seed shares, so prefixes are shared only
where a test builds them so.
"""

from __future__ import annotations

import os
from typing import Any

from hicache.core.config import DecodeConfig

PAGE = 4


def decode_config(**kw: Any) -> DecodeConfig:
    """A small decode node; keywords override any `DecodeConfig` field."""
    page = kw.get("page_size", PAGE)
    base: dict[str, Any] = dict(
        l1_pages=64,
        l2_pages=64,
        page_size=page,
        prefetch_threshold_tokens=2 * page,
        decode_reserve_tokens=page,
    )
    base.update(kw)
    return DecodeConfig(**base)


def prompt(seed: int, n: int) -> list[int]:
    """`n` token ids unique to `seed`."""
    return [seed * 100_000 + i for i in range(n)]


# How many times a test's own example count each hypothesis profile runs (tests/conftest.py).
_SCALE = {"ci": 1.0, "long": 20.0, "dev": 0.2}


def examples(n: int) -> int:
    """A property test's example count under the profile named by HICACHE_HYPOTHESIS_PROFILE:
    `n` in CI, twenty times as many under "long", a fifth under "dev"."""
    profile = os.environ.get("HICACHE_HYPOTHESIS_PROFILE", "").strip() or "ci"
    return max(1, round(n * _SCALE.get(profile, 1.0)))
