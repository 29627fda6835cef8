"""From a scenario to the simulator's resolved setups, one per baseline.

Baselines differ only in the decode node's cache, on the same workload and hardware:
- `no_decode_cache`: no radix tree on the decode node; prefill ships the whole prompt's KV;
- `l1`: a radix tree over the GPU KV pool only;
- `l1_l2`: plus host memory (`hicache_ratio` x L1);
- `l1_l2_l3`: plus the shared storage tier.
Prefill nodes are the same in every baseline (their cache follows `cluster.prefill_cache`).
"""

from __future__ import annotations

import attrs

from hicache.core.config import l2_pages
from hicache.scenarios.scenario import Scenario, ScenarioError
from hicache.sim import fit
from hicache.sim.channel import lanes_for
from hicache.sim.cluster import ClusterSetup
from hicache.sim.costs import NodeCosts
from hicache.sim.geometry import ModelGeometry, model_preset
from hicache.sim.hardware import GPU, gpu_preset, link_preset

BASELINES = ("no_decode_cache", "l1", "l1_l2", "l1_l2_l3")


def _fail(scenario: Scenario, field: str, exc: Exception) -> ScenarioError:
    return ScenarioError(scenario.source or scenario.name, field, str(exc))


def model_of(scenario: Scenario) -> ModelGeometry:
    spec = scenario.model
    fields = {
        "name": spec.name,
        "layers": spec.layers,
        "q_heads": spec.q_heads,
        "kv_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "active_params": spec.params,
        "total_params": spec.total_params,
        "dtype_bytes": spec.dtype_bytes,
        "mla_kv_lora_rank": spec.mla_kv_lora_rank,
        "mla_rope_dim": spec.mla_rope_dim,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    try:
        if spec.preset:
            return attrs.evolve(model_preset(spec.preset), **given)
        if "total_params" not in given and "active_params" in given:
            given["total_params"] = given["active_params"]
        return ModelGeometry(**given)
    except (ValueError, TypeError) as exc:
        raise _fail(scenario, "model.preset" if spec.preset else "model", exc) from None


def gpu_of(scenario: Scenario) -> GPU:
    hw = scenario.hardware
    try:
        gpu = gpu_preset(hw.gpu)
    except ValueError as exc:
        raise _fail(scenario, "hardware.gpu", exc) from None
    changes: dict[str, float] = {"efficiency": hw.efficiency}
    if hw.hbm_bandwidth is not None:
        changes["hbm_bandwidth"] = hw.hbm_bandwidth
    if hw.flops is not None:
        changes["bf16_flops"] = hw.flops
    return attrs.evolve(gpu, **changes)


def _costs(scenario: Scenario) -> NodeCosts:
    hw = scenario.hardware
    return NodeCosts(
        model_of(scenario), gpu_of(scenario), hw.gpus_per_node, scenario.cluster.decode_step_overhead
    )


def tier_pages(scenario: Scenario) -> fit.Pages:
    """Pages of a decode node's L1 and L2, and of each prefill node's (L1, L2) if it caches."""
    cache, costs = scenario.cache, _costs(scenario)
    page = cache.page_size
    try:
        capacity = costs.kv_capacity_tokens(scenario.hardware.mem_fraction)
    except ValueError as exc:
        raise _fail(scenario, "hardware.mem_fraction", exc) from None
    l1_pages = (cache.l1_tokens or capacity) // page
    l2 = cache.l2_pages_for(l1_pages)
    prefill_pages = None
    if scenario.cluster.prefill_cache:  # its L2 by the ratio alone: cache.l2_tokens is the decode node's
        p1 = capacity // page
        prefill_pages = (p1, l2_pages(p1, page, hicache_ratio=cache.hicache_ratio))
    return l1_pages, l2, prefill_pages


def prefill_estimates(costs: NodeCosts) -> dict[str, float]:
    """The decode core's estimate of prefill's compute: the cost model's own formula (linear
    in the tokens, plus attention over every earlier token), so `adaptive` sees what the
    simulated prefill node will spend (`hicache.core.promise.prefill_seconds`)."""
    m = costs.model
    return {
        "prefill_tokens_per_s": costs.flops / (2.0 * m.active_params),
        "prefill_attention_seconds": 4.0 * m.layers * m.q_heads * m.head_dim / costs.flops,
    }


def setups(scenario: Scenario) -> dict[str, ClusterSetup]:
    """The resolved setup of every baseline the scenario asks for, in its order. A cluster
    that cannot fit this machine's memory is refused first (`hicache.sim.fit`)."""
    hw, cl, st, cache = scenario.hardware, scenario.cluster, scenario.storage, scenario.cache
    model = model_of(scenario)
    costs = _costs(scenario)
    try:
        host = link_preset(hw.host_link)
    except ValueError as exc:
        raise _fail(scenario, "hardware.host_link", exc) from None
    try:
        net = link_preset(hw.network)
    except ValueError as exc:
        raise _fail(scenario, "hardware.network", exc) from None
    gpus = hw.gpus_per_node
    host_bw = (hw.host_bandwidth or host.bandwidth) * gpus
    net_bw = (hw.network_bandwidth or net.bandwidth) * gpus
    net_lat = net.latency if hw.network_latency is None else hw.network_latency
    try:
        lanes = lanes_for(net_bw, hw.transfer_rate)
    except ValueError as exc:
        raise _fail(scenario, "hardware.transfer_rate", exc) from None
    page = cache.page_size
    l1_pages, l2_pages, prefill_pages = tier_pages(scenario)
    if l1_pages < 1:
        raise _fail(scenario, "cache.l1_tokens", ValueError(f"holds no page of {page} tokens"))
    fit.check_cluster(scenario, tier_pages)
    estimates = {
        "kv_bytes_per_token": float(model.kv_bytes_per_token),
        "l3_bandwidth": st.bandwidth,
        "l3_latency": st.latency,
        "host_to_device_bandwidth": host_bw,
        "network_bandwidth": net_bw / lanes,  # one transfer's rate, under a per-transfer ceiling
        "network_latency": net_lat,
        # How prefill ships KV: streamed in layer groups during prefill, or once it is done.
        "transfer_groups": (cl.transfer_groups or model.layers) if cl.layerwise_transfer else 0,
        **prefill_estimates(costs),
    }
    # A hierarchical cache's per-step polling and collectives (cluster.hicache_step_overhead).
    hicache_costs = attrs.evolve(costs, step_overhead=costs.step_overhead + cl.hicache_step_overhead)
    out = {}
    for baseline in scenario.run.baselines:
        if baseline not in BASELINES:
            raise _fail(scenario, "run.baselines", ValueError(f"unknown baseline {baseline!r}"))
        l2 = 0 if baseline in ("no_decode_cache", "l1") else l2_pages
        try:
            decode = cache.decode_config(
                l1_pages,
                l2,
                storage=baseline == "l1_l2_l3",
                radix=baseline != "no_decode_cache",
                max_running=cl.max_running,
                **estimates,
            )
        except ValueError as exc:
            raise _fail(scenario, "cache", exc) from None
        out[baseline] = ClusterSetup(
            costs=hicache_costs if baseline in ("l1_l2", "l1_l2_l3") else costs,
            decode=decode,
            model_name=model.name,
            prefill_nodes=cl.prefill_nodes,
            decode_nodes=cl.decode_nodes,
            router=cl.router,
            prefill_cache_pages=prefill_pages,
            host_bandwidth=host_bw,
            host_latency=host.latency,
            network_bandwidth=net_bw,
            network_latency=net_lat,
            transfer_rate=hw.transfer_rate,
            storage_bandwidth=st.bandwidth,
            storage_latency=st.latency,
            storage_capacity_pages=st.capacity_tokens // page,
            tick_interval=cl.tick_interval,
            faults=scenario.faults,
            door_max_running=cl.front_door_running,
            door_max_tokens=l1_pages * page * cl.decode_nodes if cl.front_door_running else 0,
        )
    return out
