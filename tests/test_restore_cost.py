"""The shared restore-versus-recompute rule, pinned on both sides of every break-even.

Break-even bandwidths are solved by hand from the config's fields (not through the code under
test), then nudged just above (restore pays) and just below (it does not). Deleting the L2 or
the L3 rule of `choose_parts`, or the sim prefill node's L3 rule, fails one of these.
"""

from __future__ import annotations

import math

import attrs
import pytest

from hicache.core.config import DecodeConfig
from hicache.core.promise import choose_parts, l2_restore_seconds, l3_restore_seconds, receive_seconds
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
)


def _receive(cfg: DecodeConfig, tokens: int) -> float:
    return (
        cfg.network_latency
        + tokens * cfg.kv_bytes_per_token / cfg.network_bandwidth
        + tokens / cfg.prefill_tokens_per_s
    )


def _l2_break_even_h2d(cfg: DecodeConfig) -> float:
    """Host link bandwidth at which restoring the L2 span takes exactly as long as receiving it."""
    nbytes = L2_PAGES * cfg.page_size * cfg.kv_bytes_per_token
    return nbytes / _receive(cfg, L2_PAGES * cfg.page_size)


def _l3_break_even_bandwidth(cfg: DecodeConfig) -> float:
    """Storage bandwidth at which restoring the L3 span takes exactly as long as receiving it."""
    nbytes = L3_PAGES * cfg.page_size * cfg.kv_bytes_per_token
    slack = _receive(cfg, L3_PAGES * cfg.page_size) - cfg.l3_latency - nbytes / cfg.host_to_device_bandwidth
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


# --- the core: choose_parts under the adaptive promise ----------------------------------------


def test_core_restore_estimates_are_the_hand_formula() -> None:
    cfg = attrs.evolve(BASE, host_to_device_bandwidth=3e9, l3_bandwidth=2e9)
    tokens = 100
    nbytes = tokens * cfg.kv_bytes_per_token
    assert l2_restore_seconds(cfg, tokens) == nbytes / 3e9
    assert l3_restore_seconds(cfg, tokens) == cfg.l3_latency + nbytes / 2e9 + nbytes / 3e9
    assert receive_seconds(cfg, tokens) == _receive(cfg, tokens)


def test_adaptive_keeps_l2_just_above_break_even() -> None:
    cfg = attrs.evolve(BASE, host_to_device_bandwidth=_l2_break_even_h2d(BASE) * ABOVE)
    assert choose_parts(cfg, L2_PAGES, 0) == (L2_PAGES, 0)


def test_adaptive_drops_l2_just_below_break_even() -> None:
    cfg = attrs.evolve(BASE, host_to_device_bandwidth=_l2_break_even_h2d(BASE) * BELOW)
    assert choose_parts(cfg, L2_PAGES, 0) == (0, 0)


def test_dropping_l2_drops_l3_even_where_l3_alone_would_pay() -> None:
    cfg = attrs.evolve(BASE, host_to_device_bandwidth=_l2_break_even_h2d(BASE) * BELOW)
    assert choose_parts(cfg, 0, 1) == (0, 1)  # one L3 page on its own is worth restoring
    assert choose_parts(cfg, L2_PAGES, 1) == (0, 0)  # but the promise is a prefix


def test_adaptive_keeps_l3_just_above_break_even() -> None:
    cfg = attrs.evolve(BASE, l3_bandwidth=_l3_break_even_bandwidth(BASE) * ABOVE)
    assert choose_parts(cfg, L2_PAGES, L3_PAGES) == (L2_PAGES, L3_PAGES)
    assert choose_parts(cfg, 0, L3_PAGES) == (0, L3_PAGES)


def test_adaptive_drops_l3_just_below_break_even() -> None:
    cfg = attrs.evolve(BASE, l3_bandwidth=_l3_break_even_bandwidth(BASE) * BELOW)
    assert choose_parts(cfg, L2_PAGES, L3_PAGES) == (L2_PAGES, 0)
    assert choose_parts(cfg, 0, L3_PAGES) == (0, 0)


def test_adaptive_keeps_both_tiers_on_an_exact_tie() -> None:
    # Every term is exact in binary: receive = 0 + 4/4 + 4/4 = 2 s for 4 one-token pages.
    tie = attrs.evolve(
        BASE,
        page_size=1,
        kv_bytes_per_token=1.0,
        network_latency=0.0,
        network_bandwidth=4.0,
        prefill_tokens_per_s=4.0,
        l3_latency=0.0,
    )
    l2_tie = attrs.evolve(tie, host_to_device_bandwidth=2.0)  # L2: 4 / 2 = 2 s
    assert l2_restore_seconds(l2_tie, 4) == receive_seconds(l2_tie, 4) == 2.0
    assert choose_parts(l2_tie, 4, 0) == (4, 0)
    l3_tie = attrs.evolve(tie, l3_bandwidth=4.0, host_to_device_bandwidth=4.0)  # L3: 1 + 1 = 2 s
    assert l3_restore_seconds(l3_tie, 4) == receive_seconds(l3_tie, 4) == 2.0
    assert choose_parts(l3_tie, 4, 4) == (4, 4)


@pytest.mark.parametrize("policy", ["eager", "confirmed"])
def test_other_promises_keep_everything_below_break_even(policy: str) -> None:
    cfg = attrs.evolve(
        BASE,
        promise=policy,
        host_to_device_bandwidth=_l2_break_even_h2d(BASE) * BELOW,
        l3_bandwidth=_l3_break_even_bandwidth(BASE) * BELOW,
    )
    assert choose_parts(cfg, L2_PAGES, L3_PAGES) == (L2_PAGES, L3_PAGES)


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
