"""A weight matrix packed once for the CPU's matmul kernel, so a forward never re-packs it.

`x @ w` through MKL re-lays out (packs) `w` into the kernel's blocked format on every call; at
the few rows of a decode step that packing is a large part of the step (about a quarter of it at
batch 8 for the default model). oneDNN, which torch ships for its CPU backend, can pack a weight
once (`torch.ops.mkldnn._reorder_linear_weight`, what torch's own CPU compiler does for frozen
models) and multiply by the packed form (`torch.ops.mkldnn._linear_pointwise`). In bfloat16 its
kernels use the CPU's bf16 dot-product instructions (AVX512-BF16, AMX) where it has them, and
accumulate in float32. `bench/matmul_bench.py` times the default model's 30 layers and head on
a 2-core AMD EPYC, one thread: packed bfloat16 20 / 22 / 50 ms per step at 1 / 8 / 32 rows,
against 38 / 46 / 74 ms for bfloat16 `x @ w` and 34 / 77 / 139 ms for float32 (BENCHMARKS.md).

Packing is used for float32 and bfloat16 on CPU when torch has oneDNN; float64 (the exact tests'
tiny model), float16 and other builds multiply `x @ w` as before. As with MKL, the kernel
chosen depends on the number of rows, so a row's last bits may depend on the batch it is in.
"""

from __future__ import annotations

import functools

import torch

_PACKABLE = (torch.float32, torch.bfloat16)


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack and multiply weights of `dtype` on this machine."""
    if dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:  # a tiny probe: some builds register the ops but cannot run them
        w = torch.ones((4, 8), dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        out = torch.ops.mkldnn._linear_pointwise(
            torch.ones((1, 8), dtype=dtype), packed, None, "none", [], ""
        )
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.all(out == 8))


class PackedMatrix:
    """`x @ w` for a fixed `w` of shape `(in, out)`.

    Packed, the matrix is kept only in the kernel's layout (no second copy of the weights in
    memory); `dense()` gives `w` back, bit for bit, as a new tensor."""

    __slots__ = ("_packed", "_weight", "dtype", "shape")

    def __init__(self, weight: torch.Tensor, *, pack: bool = True) -> None:
        if weight.dim() != 2:
            raise ValueError(
                f"PackedMatrix: expected a 2-D (in, out) weight, got shape {tuple(weight.shape)}"
            )
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self._weight: torch.Tensor | None = weight
        self._packed: torch.Tensor | None = None
        if pack and weight.device.type == "cpu" and packing_available(weight.dtype):
            # oneDNN takes nn.Linear's (out, in); the packed copy is the kernel's own layout.
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.t().contiguous(), 1)
            self._weight = None

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def dense(self) -> torch.Tensor:
        """The `(in, out)` matrix: the one given, or (packed) a copy unpacked from the kernel's layout."""
        if self._weight is not None:
            return self._weight
        assert self._packed is not None
        return self._packed.to_dense().t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ w` for `x` of shape `(rows, in)` in the weight's dtype."""
        if self._packed is None:
            return x @ self._weight  # type: ignore[operator]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, None, "none", [], "")
