"""What a prefill node needs to serve the ranks of a tensor-parallel decode node: each rank asks
for its KV heads [lo, hi) (`heads` in its `kv` request) and gets only that slice of each page,
staged contiguously as the first part of a staging page and written from a region whose pages
are that part's size (the rank's L1 pages are)."""

from __future__ import annotations

from typing import Any

import torch

from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.transfer.base import TransferEngine
from hicache.runtime.wire import protocol


def head_parts(staging: KVPool, engine: TransferEngine) -> dict[int, tuple[Any, torch.Tensor]]:
    """For each d > 1 dividing the KV heads, the staging pool seen as pages of 1/d of the heads
    (registered with the engine now: a peer learns the regions from the hello)."""
    layout, n = staging.layout, staging.num_pages
    out = {}
    for d in range(2, layout.kv_heads + 1):
        if layout.kv_heads % d == 0 and (layout.page_bytes // d) % 8 == 0:
            shape = (n * d, layout.layers, 2, layout.page_size, layout.kv_heads // d, layout.head_dim)
            view = staging.data.view(-1).view(shape)
            region = engine.register(f"staging/{d}", staging.bytes_view().view(n * d, -1))
            out[d] = (region, view)
    return out


def heads_field(msg: dict, kv_heads: int) -> tuple[int, int] | None:
    """A TP rank's KV heads [lo, hi) from a `kv` request (None: all of them)."""
    if msg.get("heads") is None:
        return None
    heads = protocol.int_list(msg, "heads", high=kv_heads + 1)
    if len(heads) != 2 or not 0 <= heads[0] < heads[1] <= kv_heads:
        raise protocol.MessageError(f"message 'kv': field 'heads' must be [lo, hi) within {kv_heads} heads")
    lo, hi = heads
    if kv_heads % (hi - lo) or lo % (hi - lo):
        raise protocol.MessageError(f"message 'kv': heads [{lo}, {hi}) are not a rank's part of {kv_heads}")
    return lo, hi
