"""How much of a matched prefix to promise to prefill (and so restore locally).

`eager` promises L1 + L2 + L3 as soon as the L3 hit is known and overlaps the restore with the
transfer; `confirmed` promises L3 pages only once they are in L2; `adaptive` keeps a tier's part
only where restoring it is estimated to be faster than receiving it from prefill.
"""

from __future__ import annotations

from hicache.core.config import DecodeConfig


def receive_seconds(cfg: DecodeConfig, tokens: int) -> float:
    """Prefill computes the tokens and ships their KV over the P->D link."""
    return (
        cfg.network_latency
        + tokens * cfg.kv_bytes_per_token / cfg.network_bandwidth
        + tokens / (cfg.prefill_tokens_per_s)
    )


def l2_restore_seconds(cfg: DecodeConfig, tokens: int) -> float:
    return tokens * cfg.kv_bytes_per_token / cfg.host_to_device_bandwidth


def l3_restore_seconds(cfg: DecodeConfig, tokens: int) -> float:
    nbytes = tokens * cfg.kv_bytes_per_token
    return cfg.l3_latency + nbytes / cfg.l3_bandwidth + nbytes / cfg.host_to_device_bandwidth


def choose_parts(cfg: DecodeConfig, l2_pages: int, l3_pages: int) -> tuple[int, int]:
    """The L2 and L3 page counts to restore locally under the configured promise policy.

    The promise is a prefix, so L3 pages (which follow the L2 span) are used only if the L2
    span is."""
    if cfg.promise != "adaptive":
        return l2_pages, l3_pages
    p = cfg.page_size
    if l2_pages and l2_restore_seconds(cfg, l2_pages * p) > receive_seconds(cfg, l2_pages * p):
        return 0, 0
    if l3_pages and l3_restore_seconds(cfg, l3_pages * p) > receive_seconds(cfg, l3_pages * p):
        l3_pages = 0
    return l2_pages, l3_pages
