"""The KV page the storage and copy benches move: a Llama-like bf16 page of a chosen size."""

from __future__ import annotations

from hicache.runtime.kv.kv_layout import KVLayout

TOKEN_LAYER_BYTES = 2 * 8 * 128 * 2  # K and V of one token in one layer: 8 KV heads x 128 x bf16


def layout_for(page_bytes: int) -> KVLayout:
    """A Llama-like bf16 page (8 KV heads of 128) of exactly `page_bytes`."""
    tokens_layers = page_bytes // TOKEN_LAYER_BYTES
    if tokens_layers * TOKEN_LAYER_BYTES != page_bytes or tokens_layers < 1:
        raise SystemExit(f"--page-kib: {page_bytes // 1024} KiB is not a multiple of 4 KiB")
    layers = min(32, tokens_layers)
    while tokens_layers % layers:
        layers -= 1
    page_size = tokens_layers // layers
    return KVLayout(layers=layers, kv_heads=8, head_dim=128, page_size=page_size, dtype="bfloat16")
