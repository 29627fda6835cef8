"""The transfer engines a test runs against: TCP always, NIXL where `nixl` imports."""

from __future__ import annotations

import pytest


def _nixl_missing() -> str | None:
    try:
        import nixl._api  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: no NIXL here
        return f"nixl is not importable ({e!r}); install it with pip install nixl==1.5.1"
    return None


NIXL_MISSING = _nixl_missing()
ENGINES = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(NIXL_MISSING is not None, reason=str(NIXL_MISSING))),
]
