"""How much of a matched prefix to promise to prefill (and so restore locally).

`eager` promises L1 + L2 + L3 as soon as the L3 hit is known and overlaps the restore with the
transfer; `confirmed` promises L3 pages only once they are in L2; `adaptive` keeps a tier's part
only where restoring it is estimated to be faster than receiving it from prefill.
"""

from __future__ import annotations

from hicache.core.config import DecodeConfig
from hicache.core.restore_cost import RestorePath, restore_pays


def receive_seconds(cfg: DecodeConfig, tokens: int) -> float:
    """Prefill computes the tokens and ships their KV over the P->D link."""
    return (
        cfg.network_latency
        + tokens * cfg.kv_bytes_per_token / cfg.network_bandwidth
        + tokens / (cfg.prefill_tokens_per_s)
    )


def l2_path(cfg: DecodeConfig) -> RestorePath:
    """L2 pages cross only the host link; its latency is not in the estimates (it is tiny)."""
    return RestorePath(latency=0.0, bandwidth=cfg.host_to_device_bandwidth)


def l3_path(cfg: DecodeConfig) -> RestorePath:
    """L3 pages are read from storage into host memory, then cross the host link."""
    return RestorePath(
        latency=cfg.l3_latency,
        bandwidth=cfg.l3_bandwidth,
        hop_latency=0.0,
        hop_bandwidth=cfg.host_to_device_bandwidth,
    )


def l2_restore_seconds(cfg: DecodeConfig, tokens: int) -> float:
    return l2_path(cfg).seconds(tokens * cfg.kv_bytes_per_token)


def l3_restore_seconds(cfg: DecodeConfig, tokens: int) -> float:
    return l3_path(cfg).seconds(tokens * cfg.kv_bytes_per_token)


def choose_parts(cfg: DecodeConfig, l2_pages: int, l3_pages: int) -> tuple[int, int]:
    """The L2 and L3 page counts to restore locally under the configured promise policy.

    The promise is a prefix, so L3 pages (which follow the L2 span) are used only if the L2
    span is."""
    if cfg.promise != "adaptive":
        return l2_pages, l3_pages
    p = cfg.page_size
    if l2_pages and not restore_pays(
        l2_restore_seconds(cfg, l2_pages * p), receive_seconds(cfg, l2_pages * p)
    ):
        return 0, 0
    if l3_pages and not restore_pays(
        l3_restore_seconds(cfg, l3_pages * p), receive_seconds(cfg, l3_pages * p)
    ):
        l3_pages = 0
    return l2_pages, l3_pages
