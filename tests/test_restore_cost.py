"""The shared restore-versus-recompute rule, pinned on both sides of every break-even.

Break-even bandwidths are solved by hand from the config's fields (not through the code under
test), then nudged just above (restore pays) and just below (it does not). Deleting the L2 or
the L3 rule of `choose_parts`, or the sim prefill node's L3 rule, fails one of these; so does
weighing a span against the transfer of its own tokens instead of the overlap window (prefill
of the remaining prompt plus the transfer of all of it).
"""

from __future__ import annotations

import math

import attrs
import pytest

from hicache.core.config import DecodeConfig
from hicache.core.promise import (
    choose_parts,
    l2_restore_seconds,
    l3_restore_seconds,
    overlap_seconds,
    prefill_seconds,
    transfer_seconds,
)
from hicache.core.restore_cost import RestorePath, restore_pays
from hicache.sim.channel import Channel
from hicache.sim.costs import NodeCosts
from hicache.sim.engine import EventLoop
from hicache.sim.geometry import model_preset
from hicache.sim.hardware import gpu_preset
from hicache.sim.prefill import PrefillJob, PrefillNode
from hicache.sim.store import SharedStore

ABOVE = 1.001  # factors on a break-even bandwidth: clearly either side, far beyond rounding
BELOW = 0.999

L2_PAGES = 8
L3_PAGES = 4
DEVICE_PAGES = 2
PROMPT = 40 * 16 + 5  # tokens: L1, L2 and L3 spans, then 26 pages and a bit that only prefill has

BASE = DecodeConfig(
    l1_pages=64,
    l2_pages=64,
    page_size=16,
    promise="adaptive",
    kv_bytes_per_token=1000.0,
    l3_bandwidth=1e12,
    l3_latency=2e-4,
    host_to_device_bandwidth=1e12,
    network_bandwidth=1e9,
    network_latency=1e-3,
    prefill_tokens_per_s=1e5,
    prefill_attention_seconds=1e-9,
)


def _window(cfg: DecodeConfig, start: int) -> float:
    """By hand: prefill computes the prompt from token `start` on (linear + attention over every
    earlier token), then ships all of it."""
    rest = PROMPT - start
    attended = sum(start + i for i in range(rest))
    compute = rest / cfg.prefill_tokens_per_s + cfg.prefill_attention_seconds * attended
    return compute + cfg.network_latency + rest * cfg.kv_bytes_per_token / cfg.network_bandwidth


def _choose(cfg: DecodeConfig, l2: int, l3: int, device: int = DEVICE_PAGES) -> tuple[int, int]:
    return choose_parts(cfg, l2, l3, prompt_tokens=PROMPT, device_pages=device)


def _l2_break_even_h2d(cfg: DecodeConfig) -> float:
    """Host link bandwidth at which restoring the L2 span takes exactly the overlap window."""
    nbytes = L2_PAGES * cfg.page_size * cfg.kv_bytes_per_token
    return nbytes / _window(cfg, DEVICE_PAGES * cfg.page_size)


def _l3_break_even_bandwidth(cfg: DecodeConfig, l2: int = L2_PAGES) -> float:
    """Storage bandwidth at which restoring the L3 span (after L1 and `l2` L2 pages) takes
    exactly the overlap window from where it starts."""
    nbytes = L3_PAGES * cfg.page_size * cfg.kv_bytes_per_token
    start = (DEVICE_PAGES + l2) * cfg.page_size
    slack = _window(cfg, start) - cfg.l3_latency - nbytes / cfg.host_to_device_bandwidth
    assert slack > 0
    return nbytes / slack


# --- the formula ---------------------------------------------------------------------------


def test_one_hop_path_is_latency_plus_bytes_over_bandwidth() -> None:
    assert RestorePath(latency=0.5, bandwidth=100.0).seconds(200.0) == 2.5
    assert RestorePath(latency=0.5, bandwidth=100.0).seconds(200.0, queued=1.0) == 3.5


def test_two_hop_path_adds_the_second_hop_in_series() -> None:
    path = RestorePath(latency=0.5, bandwidth=100.0, hop_latency=0.25, hop_bandwidth=50.0)
    assert path.seconds(200.0) == 0.5 + 2.0 + 0.25 + 4.0
    assert path.seconds(200.0, queued=1.0) == 1.0 + 0.5 + 2.0 + 0.25 + 4.0


def test_hop_latency_without_a_hop_bandwidth_is_no_hop() -> None:
    assert RestorePath(latency=0.5, bandwidth=100.0, hop_latency=9.0).seconds(200.0) == 2.5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"latency": -1.0, "bandwidth": 1.0},
        {"latency": 0.0, "bandwidth": 0.0},
        {"latency": 0.0, "bandwidth": 1.0, "hop_latency": -1.0},
        {"latency": 0.0, "bandwidth": 1.0, "hop_bandwidth": 0.0},
    ],
)
def test_path_rejects_impossible_links(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestorePath(**kwargs)


def test_restore_pays_on_a_tie_and_not_when_strictly_slower() -> None:
    assert restore_pays(1.0, 1.0)
    assert restore_pays(math.nextafter(1.0, 0.0), 1.0)
    assert not restore_pays(math.nextafter(1.0, 2.0), 1.0)
    assert restore_pays(math.nan, 1.0)  # as both call sites did: only a known loss drops it


@pytest.mark.parametrize(("factor", "pays"), [(ABOVE, True), (BELOW, False)])
def test_formula_break_even_on_bandwidth(factor: float, pays: bool) -> None:
    nbytes, alternative = 4e6, 3e-3
    latency, hop_latency, hop_bandwidth = 5e-4, 1e-4, 8e9
    break_even = nbytes / (alternative - latency - hop_latency - nbytes / hop_bandwidth)
    path = RestorePath(latency, break_even * factor, hop_latency, hop_bandwidth)
    assert restore_pays(path.seconds(nbytes), alternative) is pays


# --- the core: choose_parts under each promise policy ------------------------------------------


def test_core_estimates_are_the_hand_formula() -> None:
    cfg = attrs.evolve(BASE, host_to_device_bandwidth=3e9, l3_bandwidth=2e9)
    tokens = 100
    nbytes = tokens * cfg.kv_bytes_per_token
    assert l2_restore_seconds(cfg, tokens) == nbytes / 3e9
    assert l3_restore_seconds(cfg, tokens) == cfg.l3_latency + nbytes / 2e9 + nbytes / 3e9
    assert transfer_seconds(cfg, tokens) == cfg.network_latency + nbytes / cfg.network_bandwidth
    assert prefill_seconds(cfg, 3, 10) == pytest.approx(3 / 1e5 + 1e-9 * (10 + 11 + 12))
    assert prefill_seconds(cfg, 0, 10) == 0.0
    for start in (0, 32, 160, PROMPT):
        assert overlap_seconds(cfg, PROMPT, start) == pytest.approx(_window(cfg, start), rel=1e-12)


def test_adaptive_keeps_l2_just_above_break_even() -> None:
    cfg = attrs.evolve(BASE, host_to_device_bandwidth=_l2_break_even_h2d(BASE) * ABOVE)
    assert _choose(cfg, L2_PAGES, 0) == (L2_PAGES, 0)


def test_adaptive_drops_l2_just_below_break_even() -> None:
    cfg = attrs.evolve(BASE, host_to_device_bandwidth=_l2_break_even_h2d(BASE) * BELOW)
    assert _choose(cfg, L2_PAGES, 0) == (0, 0)


def test_dropping_l2_drops_l3_even_where_l3_alone_would_pay() -> None:
    cfg = attrs.evolve(BASE, host_to_device_bandwidth=_l2_break_even_h2d(BASE) * BELOW)
    assert _choose(cfg, 0, 1) == (0, 1)  # one L3 page on its own is worth restoring
    assert _choose(cfg, L2_PAGES, 1) == (0, 0)  # but the promise is a prefix


def test_adaptive_keeps_l3_just_above_break_even() -> None:
    cfg = attrs.evolve(BASE, l3_bandwidth=_l3_break_even_bandwidth(BASE) * ABOVE)
    assert _choose(cfg, L2_PAGES, L3_PAGES) == (L2_PAGES, L3_PAGES)
    wider = attrs.evolve(BASE, l3_bandwidth=_l3_break_even_bandwidth(BASE, l2=0) * ABOVE)
    assert _choose(wider, 0, L3_PAGES) == (0, L3_PAGES)


def test_adaptive_drops_l3_just_below_break_even() -> None:
    cfg = attrs.evolve(BASE, l3_bandwidth=_l3_break_even_bandwidth(BASE) * BELOW)
    assert _choose(cfg, L2_PAGES, L3_PAGES) == (L2_PAGES, 0)
    narrower = attrs.evolve(BASE, l3_bandwidth=_l3_break_even_bandwidth(BASE, l2=0) * BELOW)
    assert _choose(narrower, 0, L3_PAGES) == (0, 0)


def test_the_window_starts_after_what_decode_holds() -> None:
    """More of the prompt on L1 leaves less for prefill and the transfer to hide a restore
    behind: a span that pays after two L1 pages does not after twenty."""
    cfg = attrs.evolve(BASE, l3_bandwidth=_l3_break_even_bandwidth(BASE, l2=0) * 1.5)
    assert _choose(cfg, 0, L3_PAGES) == (0, L3_PAGES)
    assert _choose(cfg, 0, L3_PAGES, device=20) == (0, 0)


def test_a_restore_slower_than_its_own_transfer_hides_behind_prefill() -> None:
    """The overlap: restoring the span takes longer than shipping those same tokens, yet less
    than prefill of the remaining prompt plus its transfer, so the span is promised."""
    cfg = attrs.evolve(BASE, l3_bandwidth=_l3_break_even_bandwidth(BASE) * ABOVE)
    tokens = L3_PAGES * cfg.page_size
    assert l3_restore_seconds(cfg, tokens) > transfer_seconds(cfg, tokens)
    assert _choose(cfg, L2_PAGES, L3_PAGES) == (L2_PAGES, L3_PAGES)


def test_adaptive_keeps_both_tiers_on_an_exact_tie() -> None:
    # Every term is exact in binary: 4 one-token pages of a 4-token prompt; prefill 4/4 = 1 s,
    # the transfer 0 + 4/4 = 1 s: a window of 2 s.
    tie = attrs.evolve(
        BASE,
        page_size=1,
        kv_bytes_per_token=1.0,
        network_latency=0.0,
        network_bandwidth=4.0,
        prefill_tokens_per_s=4.0,
        prefill_attention_seconds=0.0,
        l3_latency=0.0,
    )
    l2_tie = attrs.evolve(tie, host_to_device_bandwidth=2.0)  # L2: 4 / 2 = 2 s
    assert l2_restore_seconds(l2_tie, 4) == overlap_seconds(l2_tie, 4, 0) == 2.0
    assert choose_parts(l2_tie, 4, 0, prompt_tokens=4, device_pages=0) == (4, 0)
    l3_tie = attrs.evolve(tie, l3_bandwidth=4.0, host_to_device_bandwidth=4.0)  # L3: 1 + 1 = 2 s
    assert l3_restore_seconds(l3_tie, 4) == overlap_seconds(l3_tie, 4, 0) == 2.0
    assert choose_parts(l3_tie, 0, 4, prompt_tokens=4, device_pages=0) == (0, 4)


@pytest.mark.parametrize("policy", ["eager", "confirmed"])
@pytest.mark.parametrize("factor", [ABOVE, BELOW])
def test_other_promises_keep_everything_on_both_sides(policy: str, factor: float) -> None:
    cfg = attrs.evolve(
        BASE,
        promise=policy,
        host_to_device_bandwidth=_l2_break_even_h2d(BASE) * factor,
        l3_bandwidth=_l3_break_even_bandwidth(BASE) * factor,
    )
    assert _choose(cfg, L2_PAGES, L3_PAGES) == (L2_PAGES, L3_PAGES)


# --- the sim: a prefill node reads L3 or recomputes ------------------------------------------

PAGE = 16
PAGES = 10
HOST_BW, HOST_LAT, STORE_LAT = 63e9, 10e-6, 2e-3


def _costs() -> NodeCosts:
    return NodeCosts(model_preset("llama-3-8b"), gpu_preset("h100"), 1)


def _store_break_even_bandwidth() -> float:
    """Storage bandwidth at which reading the prompt's pages takes as long as computing them."""
    costs = _costs()
    nbytes = PAGES * PAGE * costs.model.kv_bytes_per_token
    compute = costs.prefill_seconds(PAGES * PAGE, 0)
    slack = compute - STORE_LAT - HOST_LAT - nbytes / HOST_BW
    assert slack > 0
    return nbytes / slack


def _prefill_cached_tokens(store_bandwidth: float, backlog: float = 0.0) -> int:
    """Run one prompt whose pages are all in L3 through a fresh prefill node: tokens not computed."""
    store = SharedStore(Channel("L3", store_bandwidth, STORE_LAT))
    store.channel.free_at = backlog
    keys = list(range(PAGES))
    store.add(keys)
    node = PrefillNode(
        0,
        EventLoop(),
        _costs(),
        page_size=PAGE,
        host=Channel("P0.h2d", HOST_BW, HOST_LAT),
        store=store,
        cache_pages=(64, 64),
    )
    job = PrefillJob("r0", PAGES * PAGE + 1, keys, arrival=0.0)
    node.submit(job)
    return job.cached_tokens


def test_prefill_reads_l3_just_above_break_even() -> None:
    assert _prefill_cached_tokens(_store_break_even_bandwidth() * ABOVE) == PAGES * PAGE


def test_prefill_recomputes_just_below_break_even() -> None:
    assert _prefill_cached_tokens(_store_break_even_bandwidth() * BELOW) == 0


def test_prefill_counts_the_storage_backlog() -> None:
    fast = _store_break_even_bandwidth() * 2
    assert _prefill_cached_tokens(fast) == PAGES * PAGE
    assert _prefill_cached_tokens(fast, backlog=1.0) == 0  # a second's queue outweighs the read


def test_prefill_l3_read_estimate_is_the_shared_path() -> None:
    store = SharedStore(Channel("L3", 5e9, STORE_LAT))
    store.channel.free_at = 0.25
    host = Channel("P0.h2d", HOST_BW, HOST_LAT)
    node = PrefillNode(0, EventLoop(), _costs(), page_size=PAGE, host=host, store=store, cache_pages=None)
    nbytes = 3 * PAGE * _costs().model.kv_bytes_per_token
    path = RestorePath(STORE_LAT, 5e9, HOST_LAT, HOST_BW)
    assert node._l3_read_seconds(3, 0.1) == path.seconds(nbytes, queued=0.25 - 0.1)
    assert node._l3_read_seconds(3, 0.5) == path.seconds(nbytes)  # no backlog left by then
