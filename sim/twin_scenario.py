"""The digital twin's scenario (`twin.py`): the recording's header becomes the node's own
configuration (the model's geometry, page size, L1 and L2, every cache policy, storage, node
counts and router), and its requests the samples the costs are fitted to (`hicache.sim.calibrate`),
turned into figures of a one-GPU node: FLOP/s and active parameters give the prefill rate and its
attention term, HBM bandwidth the decode step's per-context cost, the step overhead the rest of a
step, the host link and storage the restore rates, the P->D link the fitted cost per token
transferred and its latency the first token's fixed delay. The prefill node's cache is the size
the header records (`prefill_cache_bytes`; the runtime's default, 512 MiB, when a header
predates it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from hicache.core.config import DecodeConfig, hicache_ratio_of
from hicache.scenarios.scenario import (
    ClusterSpec,
    Scenario,
    apply_overrides,
    parse_scenario,
)
from hicache.scenarios.traces import (
    TRACE_HEADER,
)
from hicache.sim.calibrate import Calibration, Sample
from hicache.sim.twin_clients import infer_clients
from hicache.sim.twin_recording import Recording, TwinError

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
HEADER_KEYS = {
    TRACE_HEADER,
    "format",
    "block_size",
    "order",
    "started_at",
    "model",
    "geometry",
    "page_size",
    "l1_pages",
    "l2_pages",
    "decode_config",
    "storage",
    "nodes",
    "measured",
    "decode_nodes",
    "prefill_cache_bytes",
    "page_block_size",
    "front_door",
}
GEOMETRY_KEYS = {"layers", "kv_heads", "head_dim", "dtype", "page_bytes", "q_heads"}
STORAGE_KEYS = {"kind", "capacity_bytes", "capacity_pages"}
NODES_KEYS = {"decode", "prefill", "router"}
MEASURED_KEYS = {"link_bytes_per_s", "storage_read_bytes_per_s", "storage_write_bytes_per_s"}
FRONT_DOOR_KEYS = {"max_running", "max_tokens", "reserve_tokens"}
# The DecodeConfig fields a scenario's [cache] section sets (the rest come from the driver).
CACHE_POLICY_KEYS = (
    "eviction",
    "write_policy",
    "promise",
    "prefetch_policy",
    "prefetch_threshold_tokens",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
    "load_batches_in_flight",
    "decode_reserve_tokens",
    "transfer_retries",
    "transfer_backoff_s",
    "transfer_backoff_max_s",
    "retract_policy",
)
# The runtime's prefill cache holds 512 MiB of KV by default (runtime/prefill/prefill_cache.py): what a
# header without `prefill_cache_bytes` (older, or a prefill node the front door did not start)
# is taken to mean. The twin's one-GPU node has an H100's 80 GB of HBM.
PREFILL_CACHE_BYTES = 512 << 20
HBM_BYTES = 80e9
FAST = 1e15  # bytes/s of a link whose cost is folded into another term
NO_LIMIT = 1 << 20  # max_running when the node runs without a limit (its config says 0)


def _section(header: Mapping[str, Any], key: str, known: set[str], where: str) -> dict[str, Any]:
    value = header.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TwinError(f"{where}: field {key!r} must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise TwinError(
            f"{where}: field '{key}.{unknown[0]}': unknown; expected one of {', '.join(sorted(known))}"
        )
    return value


def _need(obj: Mapping[str, Any], key: str, where: str, name: str | None = None, low: int = 1) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise TwinError(f"{where}: field {name or key!r} must be an integer >= {low}, got {value!r}")
    return value


@attrs.frozen(slots=True)
class NodeFacts:
    """What the header says of the node, checked."""

    model: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    page_size: int
    l1_pages: int
    l2_pages: int
    decode: dict[str, Any]
    storage: bool
    storage_capacity_pages: int
    decode_nodes: int
    prefill_nodes: int
    router: str | None
    measured: dict[str, float | None]
    prefill_cache_bytes: int = PREFILL_CACHE_BYTES  # each prefill node's cache (L1); 0: none
    # The front door's requests at the decode nodes at once (0: the header names no front door),
    # which also let in only what the decode nodes' L1 holds (`cluster.front_door_running`).
    front_door_running: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def node_facts(rec: Recording) -> NodeFacts:
    """The header, every field checked: an unknown field or a missing one is named."""
    where = f"{rec.path}:1"
    h = rec.header
    unknown = sorted(set(h) - HEADER_KEYS)
    if unknown:
        raise TwinError(
            f"{where}: field {unknown[0]!r}: unknown; expected one of {', '.join(sorted(HEADER_KEYS))}"
        )
    geometry = _section(h, "geometry", GEOMETRY_KEYS, where)
    layers = _need(geometry, "layers", where, "geometry.layers")
    kv_heads = _need(geometry, "kv_heads", where, "geometry.kv_heads")
    head_dim = _need(geometry, "head_dim", where, "geometry.head_dim")
    dtype = geometry.get("dtype")
    if dtype not in DTYPE_BYTES:
        raise TwinError(
            f"{where}: field 'geometry.dtype': {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}"
        )
    q_heads = geometry.get("q_heads") or kv_heads  # the header does not say; attention FLOPs are fitted
    page = _need(h, "page_size", where)
    l1 = _need(h, "l1_pages", where)
    l2 = _need(h, "l2_pages", where, low=0)
    decode = _section(h, "decode_config", {f.name for f in attrs.fields(DecodeConfig)}, where)
    if not decode:
        raise TwinError(f"{where}: field 'decode_config' missing: the node's policies are needed")
    if decode.get("page_size", page) != page:
        raise TwinError(
            f"{where}: field 'decode_config.page_size' {decode['page_size']} differs from page_size {page}"
        )
    storage = _section(h, "storage", STORAGE_KEYS, where)
    cap = storage.get("capacity_pages")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
        raise TwinError(
            f"{where}: field 'storage.capacity_pages' must be an integer >= 0 or null, got {cap!r}"
        )
    nodes = _section(h, "nodes", NODES_KEYS, where)
    router = nodes.get("router")
    if router is not None and not isinstance(router, str):
        raise TwinError(f"{where}: field 'nodes.router' must be a string or null, got {router!r}")
    measured = _section(h, "measured", MEASURED_KEYS, where)
    door = _section(h, "front_door", FRONT_DOOR_KEYS, where)
    door_running = _need(door, "max_running", where, "front_door.max_running") if door else 0
    prefill_cache = h.get("prefill_cache_bytes")
    if prefill_cache is None:
        prefill_cache = PREFILL_CACHE_BYTES
    elif not isinstance(prefill_cache, int) or isinstance(prefill_cache, bool) or prefill_cache < 0:
        raise TwinError(
            f"{where}: field 'prefill_cache_bytes' must be an integer >= 0 or null, got {prefill_cache!r}"
        )
    for key, value in measured.items():
        if value is not None and (
            not isinstance(value, int | float) or isinstance(value, bool) or value <= 0
        ):
            raise TwinError(f"{where}: field 'measured.{key}' must be a number > 0 or null, got {value!r}")
    return NodeFacts(
        model=str(h.get("model") or "recorded"),
        layers=layers,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype_bytes=DTYPE_BYTES[dtype],
        page_size=page,
        l1_pages=l1,
        l2_pages=l2,
        decode=decode,
        storage=bool(decode.get("storage", bool(storage))),
        storage_capacity_pages=cap or 0,
        decode_nodes=_need(nodes, "decode", where, "nodes.decode") if "decode" in nodes else 1,
        prefill_nodes=(nodes.get("prefill") or 1),
        router=router,
        measured=dict(measured),
        prefill_cache_bytes=prefill_cache,
        front_door_running=door_running,
    )


def header_costs(facts: NodeFacts) -> Calibration:
    """The costs the node's own settings imply, without fitting: the study's 'before calibration'."""
    d = facts.decode
    default = DecodeConfig(l1_pages=1, l2_pages=0)
    kv = facts.kv_bytes_per_token
    return Calibration(
        prefill_tokens_per_s=float(d.get("prefill_tokens_per_s", default.prefill_tokens_per_s)),
        prefill_attention_s=float(d.get("prefill_attention_seconds", default.prefill_attention_seconds)),
        first_token_overhead_s=float(d.get("network_latency", default.network_latency)),
        decode_step_s=ClusterSpec().decode_step_overhead,
        decode_step_per_context_token_s=0.0,
        l2_seconds_per_token=kv / float(d.get("host_to_device_bandwidth", default.host_to_device_bandwidth)),
        l3_seconds_per_token=kv / float(d.get("l3_bandwidth", default.l3_bandwidth)),
        transfer_seconds_per_token=kv / float(d.get("network_bandwidth", default.network_bandwidth)),
        source="header",
    )


def decode_overlap(rec: Recording) -> dict[str, tuple[float, float]]:
    """Each request's decode (from its first token to its end, as recorded) and, over it, the
    mean number of requests decoding at once (itself included) and the mean of their contexts
    summed (a request's context: its prompt and half its output). Requests whose end is not
    recorded are left out. One sweep over the decodes' starts and ends."""
    spans = []
    for r in rec.requests:
        if r.ttft_s is None or r.finished is None:
            continue
        start, end = r.arrival + r.ttft_s, r.finished
        if end > start:
            spans.append((r.id, start, end, r.input_length + r.output_length / 2))
    if not spans:
        return {}
    edges = sorted([(s, 1.0, c) for _, s, _, c in spans] + [(e, -1.0, -c) for _, _, e, c in spans])
    times = np.array([t for t, _, _ in edges])
    count = np.cumsum([d for _, d, _ in edges])  # in force from each edge to the next
    context = np.cumsum([c for _, _, c in edges])
    gaps = np.diff(times)
    area_n = np.concatenate([[0.0], np.cumsum(count[:-1] * gaps)])
    area_c = np.concatenate([[0.0], np.cumsum(context[:-1] * gaps)])
    out = {}
    for rid, start, end, _ in spans:
        span = end - start
        n = (np.interp(end, times, area_n) - np.interp(start, times, area_n)) / span
        c = (np.interp(end, times, area_c) - np.interp(start, times, area_c)) / span
        out[rid] = (max(1.0, float(n)), float(c))
    return out


def samples(rec: Recording) -> list[Sample]:
    """The requests as the fit reads them: prefill computed what neither it nor (without a
    recorded prefill count) the decode node had cached; P->D carried what the decode node lacked
    (the recorded count, else the prompt less its cached tokens); the decode batches each one
    shared (`decode_overlap`)."""
    out = []
    batches = decode_overlap(rec)
    for r in rec.requests:
        batch, batch_context = batches.get(r.id, (None, None))
        cached = r.prefill_cached if r.prefill_cached is not None else sum(r.cached)
        transferred = r.transferred if r.transferred is not None else r.input_length - sum(r.cached)
        out.append(
            Sample(
                prompt=r.input_length,
                output=r.output_length,
                computed=max(1, r.input_length - cached),
                l2=r.cached[1],
                l3=r.cached[2],
                ttft_s=r.ttft_s,
                tpot_s=r.tpot_s,
                transferred=transferred,
                queued_s=r.queued_s,
                compute_s=r.phases.get("prefill_compute_s"),
                transfer_s=r.phases.get("transfer_s"),
                batch=batch,
                batch_context=batch_context,
            )
        )
    return out


def _decode_value(facts: NodeFacts, key: str) -> Any:
    """The node's value of a policy (the core's default where the header leaves it out), as the
    scenario writes it (an enum's value)."""
    value = facts.decode.get(key, getattr(DecodeConfig(l1_pages=1, l2_pages=0), key))
    return getattr(value, "value", value)


def scenario_doc(rec: Recording, facts: NodeFacts, cal: Calibration) -> dict[str, Any]:
    """The scenario (as TOML data) of the recorded node with `cal`'s costs."""
    kv = facts.kv_bytes_per_token
    # Prefill: tokens/s = flops / (2 params); attention pairs cost 4 layers q_heads head_dim / flops.
    lhd = 4.0 * facts.layers * facts.q_heads * facts.head_dim
    if cal.prefill_attention_s > 0:
        flops = lhd / cal.prefill_attention_s
        params = flops / (2.0 * cal.prefill_tokens_per_s)
    else:  # no attention term: parameters so many that attention is negligible beside them
        params = 1e15
        flops = 2.0 * params * cal.prefill_tokens_per_s
    # A decode step: overhead + max(weights / HBM, batch / prefill rate) + b * context. The weights
    # are made negligible (1 parameter held) and b sets the HBM bandwidth.
    hbm_eff = 0.8  # the H100 preset's hbm_efficiency
    b = cal.decode_step_per_context_token_s
    hbm = kv / (hbm_eff * b) if b > 0 else FAST
    overhead = max(0.0, cal.decode_step_s - 1.0 / cal.prefill_tokens_per_s)
    host = kv / cal.l2_seconds_per_token if cal.l2_seconds_per_token else None
    storage_bw = kv / cal.l3_seconds_per_token if cal.l3_seconds_per_token else None
    # P->D: one transfer at a time at kv / sx bytes/s (a request's transfer is the prompt less
    # what the decode node holds); no term fitted: free, its time in the prefill rate as fitted.
    network = kv / cal.transfer_seconds_per_token if cal.transfer_seconds_per_token else FAST
    d = facts.decode
    host = host or float(d.get("host_to_device_bandwidth", 25e9))
    storage_bw = (
        storage_bw or facts.measured.get("storage_read_bytes_per_s") or float(d.get("l3_bandwidth", 5e9))
    )
    l1_tokens = facts.l1_pages * facts.page_size
    l2_tokens = facts.l2_pages * facts.page_size
    ratio = hicache_ratio_of(facts.l1_pages, facts.l2_pages, facts.page_size)
    cache: dict[str, Any] = {"page_size": facts.page_size, "l1_tokens": l1_tokens}
    if ratio is not None:  # so that --set cache.hicache_ratio=R works as --hicache-ratio
        cache["hicache_ratio"] = ratio
    else:
        cache["l2_tokens"] = l2_tokens
    cache.update({k: _decode_value(facts, k) for k in CACHE_POLICY_KEYS})
    max_running = int(d.get("max_running", 0)) or NO_LIMIT
    groups = int(d.get("transfer_groups", 0))
    baseline = "l1_l2_l3" if facts.storage else ("l1_l2" if facts.l2_pages else "l1")
    workload: dict[str, Any] = {"kind": "trace", "path": str(rec.path.absolute())}
    if any(r.session for r in rec.requests):
        workload["arrivals"] = "closed"
        clients = infer_clients(rec).count
        if clients:  # as many sessions open at once as the recorded clients kept
            workload["clients"] = clients
    cluster: dict[str, Any] = {
        "prefill_nodes": facts.prefill_nodes,
        "decode_nodes": facts.decode_nodes,
        "prefill_cache": facts.prefill_cache_bytes > 0,
        "max_running": max_running,
        "decode_step_overhead": overhead,
        "hicache_step_overhead": 0.0,
    }
    if facts.router is not None:
        cluster["router"] = facts.router
    if facts.front_door_running:  # requests wait at the door, as on the node, not in the core
        cluster["front_door_running"] = facts.front_door_running
    if cal.transfer_seconds_per_token and cal.source == "fit":
        # The fitted cost is what a transferred token added to TTFT, whatever part of its transfer
        # overlapped prefill on the node: charged after prefill, it adds just that.
        cluster["layerwise_transfer"] = False
    elif "transfer_groups" in d:
        cluster.update(layerwise_transfer=groups > 0, transfer_groups=groups)
    return {
        "name": f"twin-{rec.path.stem}",
        "workload": workload,
        "model": {
            "preset": "",
            "name": facts.model[:200],
            "layers": facts.layers,
            "q_heads": facts.q_heads,
            "kv_heads": facts.kv_heads,
            "head_dim": facts.head_dim,
            "params": params,
            "total_params": 1.0,
            "dtype_bytes": facts.dtype_bytes,
        },
        "hardware": {
            "gpu": "h100",
            "gpus_per_node": 1,
            "efficiency": 1.0,
            "flops": flops,
            "hbm_bandwidth": hbm,
            "mem_fraction": _mem_fraction(facts),
            "host_bandwidth": host,
            "network_bandwidth": network,
            "network_latency": max(cal.first_token_overhead_s, 1e-9),  # the schema wants > 0
        },
        "storage": {
            "bandwidth": storage_bw,
            "latency": float(d.get("l3_latency", 2e-3)),
            "capacity_tokens": facts.storage_capacity_pages * facts.page_size,
        },
        "cluster": cluster,
        "cache": cache,
        "run": {"baselines": [baseline]},
    }


def _mem_fraction(facts: NodeFacts) -> float:
    """The share of the twin's HBM that holds as many pages as the prefill cache's bytes do (the
    decode node's L1 is given in tokens, so HBM is the prefill cache): the simulator takes the
    weights (one parameter) off first, and half a token's KV keeps float rounding off a page."""
    size = facts.prefill_cache_bytes or PREFILL_CACHE_BYTES  # none: prefill_cache is off; > 0 here
    return min(1.0, (size + facts.dtype_bytes + facts.kv_bytes_per_token / 2) / HBM_BYTES)


def scenario(rec: Recording, facts: NodeFacts, cal: Calibration, overrides: Sequence[str] = ()) -> Scenario:
    """The twin's scenario, with `--set` overrides applied; it replays one baseline."""
    source = str(rec.path)
    doc = apply_overrides(scenario_doc(rec, facts, cal), overrides)
    workload = doc.get("workload", {})
    if workload.get("arrivals") != "closed" and not any(o.startswith("workload.clients=") for o in overrides):
        workload.pop("clients", None)  # the inferred clients mean nothing to open arrivals
    out = parse_scenario(doc, source)
    if len(out.run.baselines) != 1:
        raise TwinError(f"--set: run.baselines: the twin replays one baseline, got {list(out.run.baselines)}")
    return out
