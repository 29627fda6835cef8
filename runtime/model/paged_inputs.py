"""What a paged forward is given, checked once where it comes in rather than on every step.

`check_paged` checks a batch the caller has not vouched for (`LlamaModel.forward_paged`: a
prefill's prompt, a test's batch): token ids in the vocabulary, pages in the pool and enough of
them for every position, no two new tokens writing one slot. It walks every page of every
request in Python, so the decode step does not call it: a decode node checked each value it steps
with when it took it in (`LlamaModel.decode_batch` says where), and `check_pool` and the batch's
lengths, which cost the same for any batch, are all a step checks.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import attrs
import torch

from hicache.runtime.model.llama_config import LlamaConfig


@attrs.frozen(slots=True)
class PagedRows:
    """A checked batch as plain ints: per request its pages (as many as its positions need), the
    position of its first new token, and its new tokens."""

    tables: list[list[int]]
    starts: list[int]
    tokens: list[list[int]]


def check_pool(
    config: LlamaConfig, pool: torch.Tensor, kv_dtype: torch.dtype, device: torch.device | None = None
) -> None:
    """`pool` is a contiguous `(num_pages, layers, 2, page_size, kv_heads, head_dim)` tensor of
    the model's K/V dtype, on the model's `device`; O(1), so every forward checks it."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 6:
        got = tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise ValueError(
            "pool: expected shape (num_pages, layers, 2, page_size, kv_heads, head_dim), got " + str(got)
        )
    want = (config.layers, 2, pool.shape[3], config.kv_heads, config.head_dim)
    if tuple(pool.shape[1:]) != want or pool.dtype != kv_dtype or not pool.is_contiguous():
        raise ValueError(
            f"pool: expected a contiguous (num_pages, {', '.join(map(str, want))}) tensor of "
            f"{kv_dtype} (page_size {pool.shape[3]}), got {tuple(pool.shape)} {pool.dtype}"
        )
    if device is not None and pool.device != device:
        raise ValueError(f"pool: expected a pool on the model's device {device}, got one on {pool.device}")


def check_batch_size(
    page_tables: Sequence[object], starts: Sequence[object], tokens: Sequence[object]
) -> None:
    """One page table, one position and one token row per request, and at least one request."""
    batch = len(tokens)
    if batch == 0 or len(page_tables) != batch or len(starts) != batch:
        raise ValueError(
            f"page_tables, starts/positions and tokens: expected equal non-zero lengths, got "
            f"{len(page_tables)}, {len(starts)} and {batch}"
        )


def check_paged(
    config: LlamaConfig,
    pool: torch.Tensor,
    page_tables: Sequence[Sequence[int]],
    starts: Sequence[int],
    tokens: Sequence[Sequence[int]],
    kv_dtype: torch.dtype,
    device: torch.device | None = None,
) -> PagedRows:
    """`(page_tables, starts, tokens)` checked against `config` and `pool`, as plain ints (numpy
    or torch ints accepted); a `ValueError` names the first bad argument."""
    check_pool(config, pool, kv_dtype, device)
    check_batch_size(page_tables, starts, tokens)
    num_pages, page_size = pool.shape[0], pool.shape[3]
    out = PagedRows([], [], [])
    written: set[tuple[int, int]] = set()
    for b in range(len(tokens)):
        row = [_index(t) for t in tokens[b]]
        start, table = _index(starts[b]), page_tables[b]
        if not row or not all(t is not None and 0 <= t < config.vocab for t in row):
            got = list(tokens[b])
            raise ValueError(
                f"tokens[{b}]: expected a non-empty list of ids in [0, {config.vocab}), got {got}"
            )
        if start is None or start < 0:
            raise ValueError(f"positions[{b}]: expected an integer >= 0, got {starts[b]!r}")
        need = -(-(start + len(row)) // page_size)
        if len(table) < need:
            raise ValueError(
                f"page_tables[{b}]: positions up to {start + len(row) - 1} need {need} pages of "
                f"{page_size} tokens, got {len(table)}"
            )
        pages = [_index(page) for page in table[:need]]
        for i, page in enumerate(pages):
            if page is None or not 0 <= page < num_pages:
                raise ValueError(
                    f"page_tables[{b}][{i}]: expected a page in [0, {num_pages}), got {table[i]!r}"
                )
        for p in range(start, start + len(row)):
            target = (pages[p // page_size], p % page_size)
            if target in written:
                raise ValueError(
                    f"page_tables[{b}]: position {p} would write page {target[0]} slot {target[1]}, "
                    "which another new token of this batch writes too"
                )
            written.add(target)
        out.tokens.append(row)  # type: ignore[arg-type]
        out.tables.append(pages)  # type: ignore[arg-type]
        out.starts.append(start)
    return out


def _index(value: object) -> int | None:
    """`value` as an int if it is an integer of any kind (int, numpy, 0-d tensor) but a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        return int(value) if value.dim() == 0 and not value.is_floating_point() else None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
