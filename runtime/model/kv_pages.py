"""A sequence's K/V cut into pages and put back together: the layout the KV pools hold.

A sequence's K/V is `(layers, 2, length, kv_heads, head_dim)`; a page holds all layers' K and V
for `page_size` tokens, `(layers, 2, page_size, kv_heads, head_dim)`, and a run of pages is
`(num_pages, layers, 2, page_size, kv_heads, head_dim)`. Both ways copy values exactly.
"""

from __future__ import annotations

import torch


def to_pages(kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cut `kv` `(layers, 2, length, kv_heads, head_dim)` into pages of `page_size` tokens.

    Returns a new tensor `(num_pages, layers, 2, page_size, kv_heads, head_dim)` with
    `num_pages = ceil(length / page_size)`; the tail of the last partial page is zero. Values are
    copied exactly (no arithmetic).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected an integer >= 1, got {page_size!r}")
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv: expected shape (layers, 2, length, kv_heads, head_dim), got {shape}")
    layers, _, length, heads, dim = kv.shape
    num_pages = -(-length // page_size)
    padded = kv.new_zeros((layers, 2, num_pages * page_size, heads, dim))
    padded[:, :, :length] = kv
    pages = padded.view(layers, 2, num_pages, page_size, heads, dim).permute(2, 0, 1, 3, 4, 5)
    return pages.contiguous()  # `padded` is ours, so even a view of it is a fresh tensor


def from_pages(pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens' K/V `(layers, 2, length, kv_heads, head_dim)` held by `pages`.

    `pages` is `(num_pages, layers, 2, page_size, kv_heads, head_dim)` in sequence order, and must
    hold at least `length` tokens. Returns a new contiguous tensor; values are copied exactly.
    """
    if not isinstance(pages, torch.Tensor) or pages.dim() != 6 or pages.shape[2] != 2:
        shape = tuple(pages.shape) if isinstance(pages, torch.Tensor) else type(pages).__name__
        raise ValueError(
            f"pages: expected shape (num_pages, layers, 2, page_size, kv_heads, head_dim), got {shape}"
        )
    num_pages, layers, _, page_size, heads, dim = pages.shape
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= num_pages * page_size:
        raise ValueError(
            f"length: expected an integer in [0, {num_pages * page_size}] ({num_pages} pages of "
            f"{page_size} tokens), got {length!r}"
        )
    kv = pages.permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, num_pages * page_size, heads, dim)
    out = pages.new_empty((layers, 2, length, heads, dim))
    out.copy_(kv[:, :, :length])  # always a fresh tensor: never a view of the caller's pages
    return out
