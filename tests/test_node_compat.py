"""What two nodes must agree on at connect (`runtime/wire/compat.py`): each field is checked, and a
peer that sends no profile is refused by name."""

from __future__ import annotations

import attrs
import pytest

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.model.llama import TinyConfig
from hicache.runtime.transfer.tcp import TcpEngine
from hicache.runtime.wire import compat


class NixlLike:
    kind = "nixl"


def mine() -> dict:
    layout = KVLayout(layers=2, kv_heads=2, head_dim=16, page_size=4, dtype="float64")
    return compat.profile(layout, TcpEngine(name="x"), TinyConfig())


def test_equal_profiles_agree() -> None:
    assert compat.mismatch(mine(), mine(), "peer") is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("page_size", 8),
        ("layers", 3),
        ("kv_heads", 1),
        ("head_dim", 8),
        ("dtype", "float32"),
        ("protocol", 99),
    ],
)
def test_each_field_that_differs_is_named_with_both_values(field: str, value: object) -> None:
    theirs = {**mine(), field: value}
    why = compat.mismatch(mine(), theirs, "the peer")
    assert why == f"{field} differs: {mine()[field]!r} here, {value!r} at the peer"


def test_another_model_or_engine_is_refused() -> None:
    other = compat.profile(
        KVLayout(layers=2, kv_heads=2, head_dim=16, page_size=4, dtype="float64"),
        NixlLike(),
        attrs.evolve(TinyConfig(), seed=1),
    )
    assert compat.mismatch(mine(), {**other, "engine": "tcp"}, "p").startswith("model differs")
    assert compat.mismatch(mine(), {**mine(), "engine": other["engine"]}, "p").startswith("engine differs")


def test_a_peer_without_a_profile_is_refused_by_name() -> None:
    assert "sent no node profile" in (compat.mismatch(mine(), None, "the prefill node") or "")
