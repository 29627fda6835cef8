"""Weights packed once for oneDNN (`runtime/model/packed_matrix.py`): the product is `x @ w`
(to the dtype's rounding) at any number of rows, and the packed matrix gives the weights back
bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_helpers import one_thread  # noqa: F401  (a fixture)

from hicache.runtime.model.packed_matrix import PackedMatrix, packing_available

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [d for d in (torch.float32, torch.bfloat16) if packing_available(d)]
# Relative error of one output against float64 `x @ w` of the same (rounded) inputs: float32
# accumulation order; bf16 output rounding (8 bits of mantissa: 2**-8) on top.
REL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _draw(seed: int, rows: int, k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, k), generator=gen).to(dtype)
    w = (torch.randn((k, n), generator=gen) / k**0.5).to(dtype)
    return x, w


@pytest.mark.skipif(not DTYPES, reason="this torch has no oneDNN packing")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 40),
    k=st.sampled_from([8, 64, 576]),
    n=st.sampled_from([8, 96, 832]),
)
def test_packed_product_is_x_at_w(dtype: torch.dtype, seed: int, rows: int, k: int, n: int) -> None:
    x, w = _draw(seed, rows, k, n, dtype)
    m = PackedMatrix(w)
    assert m.packed and m.shape == (k, n)
    got = m(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = x.double() @ w.double()
    scale = x.double().abs() @ w.double().abs()  # bounds the rounding of every partial sum
    assert bool(((got.double() - want).abs() <= REL[dtype] * scale + 1e-30).all())


@pytest.mark.skipif(not DTYPES, reason="this torch has no oneDNN packing")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_matrix_gives_its_weights_back_bit_for_bit(dtype: torch.dtype) -> None:
    _, w = _draw(7, 1, 576, 1536, dtype)
    m = PackedMatrix(w.clone())
    back = m.dense()
    assert back.shape == w.shape and back.dtype == dtype and back.is_contiguous()
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # compare bits, not values
    assert torch.equal(back.view(bits), w.view(bits))


def test_float64_is_multiplied_as_given() -> None:
    x, w = _draw(3, 5, 16, 24, torch.float64)
    m = PackedMatrix(w)
    assert not m.packed and m.dense() is w
    assert torch.equal(m(x), x @ w)
