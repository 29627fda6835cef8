"""Will a simulated cluster fit this machine? Checked before any node or pool is built.

Every decode node's L1 and L2 pools, and every caching prefill node's, keep a few Python words
per page slot, and every node some objects of its own; `l1_tokens = 1e12` or `decode_nodes = 1e9`
would otherwise end in a MemoryError once the pools are built. Like `hicache.scenarios.fit`, the
figures are lower bounds and `hicache.scenarios.fit.blame` picks the field to name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

from hicache.scenarios import fit
from hicache.scenarios.scenario import CacheSpec, ClusterSpec, HardwareSpec, Scenario, ScenarioError

POOL_BYTES_PER_PAGE = 40  # the core's SlotPool: ~48 bytes per slot (tests/test_sim_bad_input.py)
NODE_BYTES = 2_000  # a node's own objects, besides its pools (measured: 6-8 KB)

# (decode L1 pages, decode L2 pages, each prefill node's (L1, L2) pages or None)
Pages = tuple[int, int, tuple[int, int] | None]


def cluster_bytes(scenario: Scenario, pages: Pages) -> float:
    """A lower bound of the memory of the cluster of one baseline with the most tiers."""
    cl = scenario.cluster
    l1, l2, prefill = pages
    has_l2 = any(b in ("l1_l2", "l1_l2_l3") for b in scenario.run.baselines)
    decode = NODE_BYTES + (l1 + (l2 if has_l2 else 0)) * POOL_BYTES_PER_PAGE
    per_prefill = NODE_BYTES + (sum(prefill) * POOL_BYTES_PER_PAGE if prefill else 0)
    return cl.decode_nodes * decode + cl.prefill_nodes * per_prefill


def _variants(scenario: Scenario) -> dict[str, tuple[Scenario, Scenario]]:
    """Each field a misfit can be blamed on: the scenario with it at its default, and at its
    smallest useful value."""
    cache = scenario.cache
    l2 = ("l2_tokens", 0, 0)
    if not cache.l2_tokens:  # L2 follows L1 by the ratio
        l2 = ("hicache_ratio", CacheSpec().hicache_ratio, 0.0)
    options = {  # field: (section, key, default, smallest)
        "cluster.decode_nodes": ("cluster", "decode_nodes", ClusterSpec().decode_nodes, 1),
        "cluster.prefill_nodes": ("cluster", "prefill_nodes", ClusterSpec().prefill_nodes, 1),
        "cache.l1_tokens": ("cache", "l1_tokens", CacheSpec().l1_tokens, cache.page_size),
        f"cache.{l2[0]}": ("cache", *l2),
        "hardware.gpus_per_node": ("hardware", "gpus_per_node", HardwareSpec().gpus_per_node, 1),
        "cluster.prefill_cache": ("cluster", "prefill_cache", ClusterSpec().prefill_cache, False),
    }

    def with_value(section: str, key: str, value: object) -> Scenario:
        return attrs.evolve(scenario, **{section: attrs.evolve(getattr(scenario, section), **{key: value})})

    return {
        field: (with_value(section, key, default), with_value(section, key, low))
        for field, (section, key, default, low) in options.items()
    }


def check_cluster(scenario: Scenario, pages_of: Callable[[Scenario], Pages]) -> None:
    """Raise `ScenarioError` naming the field to blame when the cluster cannot fit."""
    budget = fit.memory_budget()
    need = cluster_bytes(scenario, pages_of(scenario))
    if need <= budget:
        return

    def estimate(variant: Scenario) -> float:
        try:
            return cluster_bytes(variant, pages_of(variant))
        except ScenarioError:  # e.g. the model does not fit on fewer GPUs
            return math.inf

    field = fit.blame(budget, estimate, _variants(scenario))
    detail = (
        f"the simulated nodes' caches need at least {fit.size(need)} of memory, more than the "
        f"{fit.size(budget)} this machine has"
    )
    raise ScenarioError(scenario.source or scenario.name, field, detail)
