"""The shape of one KV page in memory, shared by every pool and store that holds pages.

A page holds all layers' K and V for `page_size` tokens, laid out page-first as
`(layers, 2, page_size, kv_heads, head_dim)`: one page is one contiguous run of bytes, so moving a
page between tiers (and to or from a file) is a single memcpy, whatever the model.
"""

from __future__ import annotations

import functools

import attrs
import torch

_INTEGER_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)}
)


@functools.cache
def _torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name`; only plain element types (no quantized ones), whose bytes
    are the values themselves."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"KVLayout.dtype: {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    if not (dtype.is_floating_point or dtype.is_complex or dtype in _INTEGER_DTYPES):
        raise ValueError(f"KVLayout.dtype: {name!r} is not a plain floating-point or integer dtype")
    return dtype


def _canonical_dtype(name: str) -> str:
    """'float' and 'half' name the same dtypes as 'float32' and 'float16': store one spelling, so
    layouts compare equal and file headers agree."""
    return str(_torch_dtype(name)).removeprefix("torch.")


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"KVLayout.{attribute.name}: expected a positive int, got {value!r}")


@attrs.frozen(slots=True)
class KVLayout:
    """Model geometry as the KV pools see it; `dtype` is a torch dtype name."""

    layers: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    page_size: int = attrs.field(validator=_positive)
    dtype: str = attrs.field(converter=_canonical_dtype)

    def __attrs_post_init__(self) -> None:
        # Copies scatter pages through an int64 view of their bytes (torch's CPU scatter is
        # element-wise, so the widest element is the fastest): a page must be whole 8-byte words.
        if self.page_bytes % 8:
            raise ValueError(
                f"KVLayout: a page of {self.page_bytes} bytes ({self.page_shape} x {self.dtype}) "
                "is not a multiple of 8 bytes"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def page_elems(self) -> int:
        return self.layers * 2 * self.page_size * self.kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.itemsize

    @property
    def page_words(self) -> int:
        """Page size in int64 words."""
        return self.page_bytes // 8

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token over all layers."""
        return self.page_bytes // self.page_size
