"""How much of a matched prefix to promise to prefill (and so restore locally).

`eager` promises L1 + L2 + L3 as soon as the L3 hit is known and overlaps the restore with the
transfer; `confirmed` promises L3 pages only once they are in L2; `adaptive` keeps a tier's part
only where restoring it is estimated not to delay the request.

A restore runs while prefill computes the prompt and ships the unpromised rest of it: prefill
computes every prompt token its own cache lacks whatever the decode node promises. Without a
tier's span the request waits until the transfer of the whole remaining prompt (the span
included) has landed; with it, for the longer of the restore and a shorter transfer. So the
span pays when its restore fits within the time that transfer takes to land — the overlap
window. When KV is sent once prefill is done, that is prefill plus the transfer; when it streams
in G layer groups during prefill (`transfer_groups`), the transfer hides behind prefill and the
window is max(P/G + T, P + T/G) for prefill time P and transfer time T: the last group leaves
when prefill ends or when the link has carried the rest, whichever is later. Comparing the
restore with the transfer of the same tokens alone would refuse restores that hide behind
prefill (24% slower than `eager` in docs/validation.md study 3, before this rule), and ignoring
the streaming would accept restores that outlast the streamed transfer (up to 33% slower).
"""

from __future__ import annotations

from hicache.core.config import DecodeConfig
from hicache.core.restore_cost import RestorePath, restore_pays


def prefill_seconds(cfg: DecodeConfig, tokens: int, context: int) -> float:
    """Prefill computing `tokens` that follow `context` earlier ones: a linear rate plus
    attention over every earlier token (the simulator's cost model has the same shape)."""
    if tokens <= 0:
        return 0.0
    attended = tokens * context + tokens * (tokens - 1) / 2
    return tokens / cfg.prefill_tokens_per_s + cfg.prefill_attention_seconds * attended


def transfer_seconds(cfg: DecodeConfig, tokens: int) -> float:
    """Shipping `tokens` of KV over the P->D link."""
    return cfg.network_latency + tokens * cfg.kv_bytes_per_token / cfg.network_bandwidth


def overlap_seconds(cfg: DecodeConfig, prompt_tokens: int, start: int) -> float:
    """What a restore of the prompt from token `start` on hides behind: the transfer of the
    rest of the prompt landing, after prefill (or streamed during it) computed it."""
    rest = max(0, prompt_tokens - start)
    compute = prefill_seconds(cfg, rest, start)
    groups = cfg.transfer_groups
    if not groups:
        return compute + transfer_seconds(cfg, rest)
    wire = rest * cfg.kv_bytes_per_token / cfg.network_bandwidth
    return cfg.network_latency + max(compute / groups + wire, compute + wire / groups)


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


def choose_parts(
    cfg: DecodeConfig, l2_pages: int, l3_pages: int, *, prompt_tokens: int, device_pages: int
) -> tuple[int, int]:
    """The L2 and L3 page counts to restore locally under the configured promise policy, for a
    prompt of `prompt_tokens` whose first `device_pages` pages are on L1 already.

    The promise is a prefix, so L3 pages (which follow the L2 span) are used only if the L2
    span is. Each span is weighed against the overlap window from where it starts."""
    if cfg.promise != "adaptive":
        return l2_pages, l3_pages
    p = cfg.page_size
    start = device_pages * p
    if l2_pages and not restore_pays(
        l2_restore_seconds(cfg, l2_pages * p), overlap_seconds(cfg, prompt_tokens, start)
    ):
        return 0, 0
    start += l2_pages * p
    if l3_pages and not restore_pays(
        l3_restore_seconds(cfg, l3_pages * p), overlap_seconds(cfg, prompt_tokens, start)
    ):
        l3_pages = 0
    return l2_pages, l3_pages
