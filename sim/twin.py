"""The digital twin: a trace recorded by `hicache serve --record-trace` replayed in the simulator,
on the recorded node's own configuration and on costs fitted to its own measurements, to see how
well the simulator predicts what the node did, and then what another configuration would do.

The recording's header becomes the scenario: the model's geometry (a custom model), page size,
L1 and L2 in tokens, every cache policy, storage, node counts and router. The node's hardware
is not a preset, so the costs are fitted from the requests' TTFT and TPOT (`hicache.sim.calibrate`)
and turned into figures of a one-GPU node: FLOP/s and active parameters give the prefill rate
and its attention term, HBM bandwidth the decode step's per-context cost, the step overhead the
rest of a step, the host link and storage the restore rates, the P->D link the fitted cost per
token transferred (so a what-if that keeps more pages on the decode node sees the transfers they
save) and its latency the first token's fixed delay. The prefill node's cache is the size the
header records (`prefill_cache_bytes`; the runtime's default, 512 MiB, when a header predates it).

Requests are replayed with their recorded block ids. A session's next prompt names, block by
block, what its previous answer left in the cache, so a request's output pages take the keys of
the following request of its session where that one extends its prompt (other output pages stay
private, as for any trace). Sessions replay closed-loop: a turn is sent once the previous one is
answered, after the client's own pause (the gap between arrivals less the previous request's
measured response time).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from hicache.core.config import DecodeConfig, hicache_ratio_of
from hicache.results import RequestRecord
from hicache.scenarios.scenario import (
    ClusterSpec,
    Scenario,
    apply_overrides,
    parse_scenario,
)
from hicache.scenarios.traces import (
    TRACE_HEADER,
    TraceError,
    _block_ids,
    _int_field,
    _json,
    _num_field,
    _text,
)
from hicache.scenarios.workload import WorkItem
from hicache.sim.calibrate import Calibration, Sample, fit
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups

HEADER_VERSION = 1  # the header version this twin reads
TIERS = ("l1", "l2", "l3")
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
}
GEOMETRY_KEYS = {"layers", "kv_heads", "head_dim", "dtype", "page_bytes", "q_heads"}
STORAGE_KEYS = {"kind", "capacity_bytes", "capacity_pages"}
NODES_KEYS = {"decode", "prefill", "router"}
MEASURED_KEYS = {"link_bytes_per_s", "storage_read_bytes_per_s", "storage_write_bytes_per_s"}
LINE_KEYS = {
    "timestamp",
    "input_length",
    "output_length",
    "hash_ids",
    "session_id",
    "tenant",
    "cached_tokens",
    "prefill_cached_tokens",
    "transferred_tokens",
    "ttft_s",
    "tpot_s",
    "finish_reason",
}
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
OVERLAP_SLACK_S = 0.02  # the rounding of a recorded end: TTFT + mean TPOT x (output - 1)
NO_LIMIT = 1 << 20  # max_running when the node runs without a limit (its config says 0)


class TwinError(ValueError):
    """A recording the twin cannot replay; the message names the file, line and field."""


@attrs.frozen(slots=True)
class Recorded:
    """One request line: what the node served and what it measured."""

    id: str
    line: int
    arrival: float  # s from the recording's start
    input_length: int
    output_length: int
    block_ids: tuple[int, ...]
    session: str
    cached: tuple[int, int, int]  # tokens restored from L1, L2, L3
    prefill_cached: int | None
    transferred: int | None  # prompt tokens whose KV crossed P->D (None: not recorded)
    ttft_s: float | None
    tpot_s: float | None
    finish_reason: str | None

    @property
    def answered(self) -> bool:
        return self.ttft_s is not None

    @property
    def e2e_s(self) -> float | None:
        if self.ttft_s is None:
            return None
        return self.ttft_s + (self.tpot_s or 0.0) * max(0, self.output_length - 1)


@attrs.frozen(slots=True)
class Recording:
    path: Path
    header: dict[str, Any]
    block_size: int
    requests: tuple[Recorded, ...]  # in arrival order

    @property
    def one_at_a_time(self) -> bool:
        """No two requests were in flight at once: each arrived after the one before had been
        answered (within `OVERLAP_SLACK_S`, the measured end being TTFT + TPOT x (output - 1))."""
        end = -math.inf
        for r in self.requests:
            if r.e2e_s is None or r.arrival < end - OVERLAP_SLACK_S:
                return False
            end = r.arrival + r.e2e_s
        return True


# ------------------------------------------------------------------------------ reading


def _optional_number(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    if obj.get(key) is None:
        return None
    return _num_field(dict(obj), key, where)


def _header(path: Path, raw: bytes | None) -> dict[str, Any]:
    where = f"{path}:1"
    if raw is None or not raw.strip():
        raise TwinError(f"{where}: empty file: expected a recorded trace's header line")
    obj = _json(_text(raw, where), where, "not a JSON object")
    if not isinstance(obj, dict) or TRACE_HEADER not in obj:
        raise TwinError(
            f"{where}: field {TRACE_HEADER!r} missing: not a trace recorded by `hicache serve "
            "--record-trace` (the twin needs the node's configuration in the header)"
        )
    version = obj[TRACE_HEADER]
    if version != HEADER_VERSION:
        raise TwinError(
            f"{where}: field {TRACE_HEADER!r}: version {version!r}, this twin reads {HEADER_VERSION}"
        )
    return obj


def _request(obj: Any, where: str, index: int, block: int) -> Recorded:
    if not isinstance(obj, dict):
        raise TwinError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - LINE_KEYS)
    if unknown:
        raise TwinError(
            f"{where}: field {unknown[0]!r}: unknown; expected one of {', '.join(sorted(LINE_KEYS))}"
        )
    ts = _num_field(obj, "timestamp", where)
    n_in = _int_field(obj, "input_length", where, low=1)
    n_out = _int_field(obj, "output_length", where)
    ids = _block_ids(obj, "hash_ids", where, n_in, block, partial_last=True)
    session = obj.get("session_id")
    if session is not None and (not isinstance(session, int) or isinstance(session, bool) or session < 0):
        raise TwinError(f"{where}: field 'session_id' must be an integer >= 0, got {session!r}")
    cached = obj.get("cached_tokens")
    if not isinstance(cached, dict) or set(cached) - set(TIERS):
        raise TwinError(f"{where}: field 'cached_tokens' must be an object of l1, l2, l3 token counts")
    tiers = tuple(
        _int_field(cached, t, f"{where}: cached_tokens", low=0) if t in cached else 0 for t in TIERS
    )
    if sum(tiers) > n_in:
        raise TwinError(f"{where}: field 'cached_tokens' sums to {sum(tiers)}, more than input_length {n_in}")
    prefill = obj.get("prefill_cached_tokens")
    if prefill is not None:
        prefill = _int_field(obj, "prefill_cached_tokens", where)
    transferred = obj.get("transferred_tokens")
    if transferred is not None:
        transferred = _int_field(obj, "transferred_tokens", where, low=0)
        if transferred > n_in:
            raise TwinError(
                f"{where}: field 'transferred_tokens' is {transferred}, more than input_length {n_in}"
            )
    finish = obj.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise TwinError(f"{where}: field 'finish_reason' must be a string or null, got {finish!r}")
    return Recorded(
        id=f"line{where.rsplit(':', 1)[1]}",
        line=index,
        arrival=ts / 1000.0,
        input_length=n_in,
        output_length=n_out,
        block_ids=ids,
        session="" if session is None else f"s{session}",
        cached=tiers,  # type: ignore[arg-type]
        prefill_cached=prefill,
        transferred=transferred,
        ttft_s=_optional_number(obj, "ttft_s", where),
        tpot_s=_optional_number(obj, "tpot_s", where),
        finish_reason=finish,
    )


def read_recording(path: str | Path) -> Recording:
    """The header and every request of a recorded trace, sorted by arrival (lines are written in
    completion order); `TwinError` naming the file, line and field otherwise."""
    path = Path(path)
    try:
        f = path.open("rb")
    except OSError as exc:
        raise TwinError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    requests: list[Recorded] = []
    with f:
        header = _header(path, f.readline())
        block = header.get("block_size")
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise TwinError(f"{path}:1: field 'block_size' must be an integer >= 1, got {block!r}")
        try:
            for lineno, raw in enumerate(f, 2):
                where = f"{path}:{lineno}"
                text = _text(raw, where)
                if text.strip():
                    requests.append(_request(_json(text, where, "not a JSON object"), where, lineno, block))
        except TraceError as exc:
            raise TwinError(str(exc)) from None
    if not requests:
        raise TwinError(f"{path}: the recording holds no request")
    requests.sort(key=lambda r: (r.arrival, r.line))
    return Recording(path, header, block, tuple(requests))


# ------------------------------------------------------------------------------ the scenario


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


def samples(rec: Recording) -> list[Sample]:
    """The requests as the fit reads them: prefill computed what neither it nor (without a
    recorded prefill count) the decode node had cached; P->D carried what the decode node lacked
    (the recorded count, else the prompt less its cached tokens)."""
    out = []
    for r in rec.requests:
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
    out = parse_scenario(doc, source)
    if len(out.run.baselines) != 1:
        raise TwinError(f"--set: run.baselines: the twin replays one baseline, got {list(out.run.baselines)}")
    return out


# ------------------------------------------------------------------------------ the replay


def work_items(
    rec: Recording, page_size: int, model: str, *, closed: bool = True
) -> tuple[list[WorkItem], dict[str, np.ndarray]]:
    """The requests to replay and each one's sequence page keys (see the module's docstring);
    `closed`: a session's later turns wait for the turn before (else they arrive as recorded)."""
    items = []
    for r in rec.requests:
        items.append(
            WorkItem(
                r.id,
                r.arrival,
                r.input_length,
                r.output_length,
                session=r.session,
                blocks=r.block_ids,
                block_size=rec.block_size,
            )
        )
    keys = {item.id: item.sequence_keys(page_size, model).copy() for item in items}
    previous: dict[str, tuple[WorkItem, Recorded]] = {}
    out = []
    for item, r in zip(items, rec.requests, strict=True):
        before = previous.get(item.session) if item.session else None
        if before is not None:
            prior, prior_rec = before
            _inherit_output(keys[prior.id], prior, keys[item.id], item, page_size)
            e2e = prior_rec.e2e_s
            gap = item.arrival - prior.arrival
            if closed:
                item = attrs.evolve(item, think=max(0.0, gap - e2e) if e2e is not None else gap)
        if item.session:
            previous[item.session] = (item, r)
        out.append(item)
    return out, keys


def _inherit_output(prior: np.ndarray, a: WorkItem, after: np.ndarray, b: WorkItem, page: int) -> None:
    """`a`'s output pages take the keys of `b`'s prompt where `b` extends `a`'s prompt."""
    n_a, n_b = a.prompt_len // page, b.prompt_len // page
    if n_b <= n_a or not np.array_equal(prior[:n_a], after[:n_a]):
        return
    upto = min((a.prompt_len + a.output_len) // page, n_b)
    prior[n_a:upto] = after[n_a:upto]


def one_client(rec: Recording, sc: Scenario) -> bool:
    """Replay one request at a time: a closed loop of a recording whose client sent one request
    at a time. Otherwise a replayed turn that runs longer than it did on the node would overlap
    the next one, which on the node it never did, and their pages would compete for L1."""
    return sc.workload.closed and sc.workload.clients == 0 and rec.one_at_a_time


def replay(rec: Recording, sc: Scenario) -> dict[str, RequestRecord]:
    """The simulator's record of every request of `rec` under scenario `sc`, by id."""
    (setup,) = setups(sc).values()
    items, keys = work_items(rec, setup.decode.page_size, setup.model_name, closed=sc.workload.closed)
    cluster = Cluster(setup)
    if one_client(rec, sc):
        result = cluster.run(items, keys=keys, sequential=True)
    else:
        result = cluster.run(items, keys=keys, clients=sc.workload.clients, until=sc.run.until)
    return {r.id: r for r in result.records}


# ------------------------------------------------------------------------------ the comparison


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if arr.size == 0:
        return {"mean": None, "p90": None}
    return {"mean": float(arr.mean()), "p90": float(np.percentile(arr, 90))}


def overall(rec: Recording, predicted: Mapping[str, RequestRecord] | None) -> dict[str, Any]:
    """Hit rate, tiers, TTFT and TPOT over the requests answered (both measured and predicted
    where `predicted` is given; the measured figures alone otherwise)."""
    ids = [r for r in rec.requests if r.answered]
    if predicted is not None:
        ids = [r for r in ids if r.id in predicted and predicted[r.id].outcome == "finished"]
    prompt = sum(r.input_length for r in ids)
    if predicted is None:
        tiers = [sum(r.cached[i] for r in ids) for i in range(3)]
        ttft = [r.ttft_s for r in ids]
        tpot = [r.tpot_s for r in ids if r.output_length > 1]
    else:
        p = [predicted[r.id] for r in ids]
        tiers = [sum(x.cached_l1 for x in p), sum(x.cached_l2 for x in p), sum(x.cached_l3 for x in p)]
        ttft = [x.ttft_s for x in p]
        tpot = [x.tpot_s for x in p if x.output_tokens > 1]
    t, tp = _dist(ttft), _dist(tpot)  # type: ignore[arg-type]
    return {
        "requests": len(ids),
        "hit_rate": sum(tiers) / prompt if prompt else 0.0,
        "cached_tokens": dict(zip(TIERS, tiers, strict=True)),
        "ttft_mean_s": t["mean"],
        "ttft_p90_s": t["p90"],
        "tpot_mean_s": tp["mean"],
    }


def errors(measured: Mapping[str, Any], predicted: Mapping[str, Any]) -> dict[str, float | None]:
    """Prediction errors: the hit rate in percentage points, times relative to the measured."""

    def rel(key: str) -> float | None:
        m, p = measured.get(key), predicted.get(key)
        return None if m is None or p is None or m == 0 else (p - m) / m

    return {
        "hit_rate_pp": 100.0 * (predicted["hit_rate"] - measured["hit_rate"]),
        "ttft_mean": rel("ttft_mean_s"),
        "ttft_p90": rel("ttft_p90_s"),
        "tpot_mean": rel("tpot_mean_s"),
    }


def ttft_request_error(rec: Recording, predicted: Mapping[str, RequestRecord]) -> float | None:
    """The mean relative TTFT error per request: unlike the error of the mean, which a fitted
    constant makes small by construction, this says how far one prediction is to be trusted, and
    so how small a predicted change can be told from none."""
    errs = []
    for r in rec.requests:
        p = predicted.get(r.id)
        if r.answered and r.ttft_s and p is not None and p.outcome == "finished" and not math.isnan(p.ttft_s):
            errs.append(abs(p.ttft_s - r.ttft_s) / r.ttft_s)
    return float(np.mean(errs)) if errs else None


def tiers_equal(rec: Recording, predicted: Mapping[str, RequestRecord]) -> int:
    """Requests whose restored tokens per tier the replay predicted exactly."""
    n = 0
    for r in rec.requests:
        p = predicted.get(r.id)
        if p is not None and (p.cached_l1, p.cached_l2, p.cached_l3) == r.cached:
            n += 1
    return n


def request_rows(
    rec: Recording, base: Mapping[str, RequestRecord], what_if: Mapping[str, RequestRecord] | None
) -> Iterator[dict[str, Any]]:
    """requests.csv's rows: measured and predicted tiers and times of each request."""

    def num(x: float | None) -> float | str:
        return "" if x is None or math.isnan(x) else round(x, 6)

    for r in rec.requests:
        p = base.get(r.id)
        row: dict[str, Any] = {
            "id": r.id,
            "session": r.session,
            "arrival_s": round(r.arrival, 6),
            "input_length": r.input_length,
            "output_length": r.output_length,
            **{f"measured_{t}": r.cached[i] for i, t in enumerate(TIERS)},
            **{f"predicted_{t}": getattr(p, f"cached_{t}") if p else "" for t in TIERS},
            "measured_ttft_s": num(r.ttft_s),
            "predicted_ttft_s": num(p.ttft_s) if p else "",
            "measured_tpot_s": num(r.tpot_s),
            "predicted_tpot_s": num(p.tpot_s) if p else "",
            # P->D tokens: what a decode-side hit saves (the fit's transfer term)
            "measured_transferred": "" if r.transferred is None else r.transferred,
            "predicted_transferred": p.transferred_tokens if p else "",
        }
        if what_if is not None:
            w = what_if.get(r.id)
            row.update({f"what_if_{t}": getattr(w, f"cached_{t}") if w else "" for t in TIERS})
            row["what_if_ttft_s"] = num(w.ttft_s) if w else ""
            row["what_if_transferred"] = w.transferred_tokens if w else ""
        yield row


# ------------------------------------------------------------------------------ the command


@attrs.frozen(slots=True)
class TwinResult:
    recording: Recording
    calibration: Calibration
    baseline: str
    measured: dict[str, Any]
    predicted: dict[str, Any]
    errors: dict[str, float | None]
    records: dict[str, RequestRecord]
    tiers_equal: int
    sequential: bool = False  # replayed one request at a time (`one_client`)
    overrides: tuple[str, ...] = ()
    what_if: dict[str, Any] | None = None
    what_if_baseline: str | None = None
    what_if_records: dict[str, RequestRecord] | None = None


def twin(
    path: str | Path, overrides: Sequence[str] = (), *, calibrate: bool = True, common: Sequence[str] = ()
) -> TwinResult:
    """Replay the recording at `path` as recorded (the prediction of what the node did) and, with
    `overrides`, again with them applied (the what-if). `common` overrides apply to both (e.g.
    `workload.arrivals=open`: turns arrive when they were recorded instead of after the turn
    before)."""
    rec = read_recording(path)
    facts = node_facts(rec)
    if calibrate:
        try:
            cal = fit(samples(rec))
        except ValueError as exc:
            raise TwinError(f"{rec.path}: {exc}") from None
    else:
        cal = header_costs(facts)
    base_sc = scenario(rec, facts, cal, common)
    base = replay(rec, base_sc)
    sequential = one_client(rec, base_sc)
    measured = overall(rec, None)
    predicted = overall(rec, base)
    out = TwinResult(
        recording=rec,
        calibration=cal,
        baseline=base_sc.run.baselines[0],
        measured=measured,
        predicted=predicted,
        errors={**errors(measured, predicted), "ttft_per_request": ttft_request_error(rec, base)},
        records=base,
        tiers_equal=tiers_equal(rec, base),
        sequential=sequential,
    )
    if not overrides:
        return out
    what_sc = scenario(rec, facts, cal, [*common, *overrides])
    what = replay(rec, what_sc)
    return attrs.evolve(
        out,
        overrides=tuple(overrides),
        what_if=overall(rec, what),
        what_if_baseline=what_sc.run.baselines[0],
        what_if_records=what,
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def report(res: TwinResult) -> str:
    """The table the command prints."""
    c = res.calibration
    n = len(res.recording.requests)
    lines = [
        f"recording        {res.recording.path} ({n} requests, blocks of {res.recording.block_size} tokens)",
        f"replayed as      {res.baseline}"
        + (", one request at a time (as the recorded client sent them)" if res.sequential else ""),
        f"calibration      ({c.source}) prefill {c.prefill_tokens_per_s:,.0f} tok/s, attention "
        f"{c.prefill_attention_s:.3g} s/pair, first-token overhead {c.first_token_overhead_s * 1e3:.2f} ms, "
        f"decode step {c.decode_step_s * 1e3:.2f} ms"
        f" + {c.decode_step_per_context_token_s * 1e6:.3f} us/ctx token",
        f"                 P->D {_rate(c.transfer_seconds_per_token)}, "
        f"L2 restore {_rate(c.l2_seconds_per_token)}, "
        f"L3 restore {_rate(c.l3_seconds_per_token)}; "
        f"residuals rms TTFT {c.ttft_residual_rms_s * 1e3:.2f} ms ({c.ttft_rows} req), "
        f"TPOT {c.tpot_residual_rms_s * 1e3:.2f} ms ({c.tpot_rows} req)",
        f"tiers equal      {res.tiers_equal}/{n} requests (L1, L2, L3 restored tokens as measured)",
        "",
    ]
    head = f"{'metric':<16}{'measured':>12}{'predicted':>12}{'error':>10}"
    if res.what_if is not None:
        head += f"{'what-if':>12}{'change':>10}"
    lines.append(head)
    rows = [
        ("hit rate", "hit_rate", lambda x: f"{x:.1%}", "hit_rate_pp"),
        ("TTFT mean s", "ttft_mean_s", _s, "ttft_mean"),
        ("TTFT p90 s", "ttft_p90_s", _s, "ttft_p90"),
        ("TPOT mean s", "tpot_mean_s", _s, "tpot_mean"),
    ]
    for label, key, fmt, err in rows:
        e = res.errors[err]
        shown = "-" if e is None else (f"{e:+.1f}pp" if err == "hit_rate_pp" else _pct(e))
        line = f"{label:<16}{fmt(res.measured[key]):>12}{fmt(res.predicted[key]):>12}{shown:>10}"
        if res.what_if is not None:
            w, p = res.what_if[key], res.predicted[key]
            if key == "hit_rate":
                change = f"{100 * (w - p):+.1f}pp"
            else:
                change = "-" if w is None or not p else _pct((w - p) / p)
            line += f"{fmt(w):>12}{change:>10}"
        lines.append(line)
    per_request_error = res.errors.get("ttft_per_request")
    if per_request_error is not None:
        lines.append(f"{'TTFT per request':<16}{'':>12}{'':>12}{per_request_error:>9.1%}  (mean |error|)")
    for i, tier in enumerate(TIERS):
        line = (
            f"{'cached ' + tier.upper():<16}{res.measured['cached_tokens'][tier]:>12}"
            f"{res.predicted['cached_tokens'][tier]:>12}{'':>10}"
        )
        if res.what_if is not None:
            line += f"{res.what_if['cached_tokens'][tier]:>12}"
        lines.append(line)
        del i
    if res.what_if is not None:
        lines.append(
            f"(what-if: {' '.join(res.overrides)}, replayed as {res.what_if_baseline}; change is against the "
            "predicted baseline, whose error above bounds how far to trust it)"
        )
    return "\n".join([*lines, "", *per_request(res)])


PER_REQUEST_ROWS = 40  # printed in full up to this many requests; beyond, only those that differ


def per_request(res: TwinResult) -> list[str]:
    """Measured against predicted, request by request (all of a short recording, else the
    requests whose tiers differ, up to `PER_REQUEST_ROWS`)."""
    rows = list(request_rows(res.recording, res.records, None))
    short = len(rows) <= PER_REQUEST_ROWS

    def tiers(row: dict[str, Any], who: str) -> tuple[Any, ...]:
        return tuple(row[f"{who}_{t}"] for t in TIERS)

    shown = [r for r in rows if short or tiers(r, "measured") != tiers(r, "predicted")]
    if not shown:
        return ["every request's L1/L2/L3 tokens as measured (per request: requests.csv with --out)"]
    what = "per request" if short else f"requests whose tiers differ (first {PER_REQUEST_ROWS})"
    out = [
        f"{what}: L1/L2/L3 tokens and TTFT s, measured -> predicted",
        f"{'id':<10}{'session':>8}{'prompt':>8}  {'measured':>16}  {'predicted':>16}"
        f"{'TTFT':>9}{'->':>3}{'TTFT':>9}",
    ]
    for r in shown[:PER_REQUEST_ROWS]:
        m, p = tiers(r, "measured"), tiers(r, "predicted")
        mark = "" if m == p else "  *"
        out.append(
            f"{r['id']:<10}{r['session']:>8}{r['input_length']:>8}  {'/'.join(map(str, m)):>16}  "
            f"{'/'.join(map(str, p)):>16}{_cell(r['measured_ttft_s']):>9}{'':>3}"
            f"{_cell(r['predicted_ttft_s']):>9}{mark}"
        )
    return out


def _cell(x: float | str) -> str:
    return "-" if x == "" else f"{x:.3f}"


def _rate(seconds_per_token: float | None) -> str:
    return "not fitted" if not seconds_per_token else f"{1 / seconds_per_token:,.0f} tok/s"


def summary_doc(res: TwinResult, sc_doc: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """summary.json: the overall figures, flat, then the calibration and the what-if."""
    out: dict[str, Any] = {
        "recording": str(res.recording.path),
        "baseline": res.baseline,
        "one_request_at_a_time": res.sequential,
    }
    for key in ("hit_rate", "ttft_mean_s", "ttft_p90_s", "tpot_mean_s"):
        out[f"predicted_{key}"] = res.predicted[key]
        out[f"measured_{key}"] = res.measured[key]
    out["predicted_cached_tokens"] = res.predicted["cached_tokens"]
    out["measured_cached_tokens"] = res.measured["cached_tokens"]
    out["requests"] = len(res.recording.requests)
    out["compared_requests"] = res.predicted["requests"]
    out["tiers_equal"] = res.tiers_equal
    out["errors"] = res.errors
    out["calibration"] = res.calibration.to_dict()
    if res.what_if is not None:
        out["what_if"] = {
            "overrides": list(res.overrides),
            "baseline": res.what_if_baseline,
            **{f"predicted_{k}": v for k, v in res.what_if.items() if k != "requests"},
        }
    if sc_doc is not None:
        out["scenario"] = dict(sc_doc)
    return out


def write_outputs(out: Path, res: TwinResult) -> list[Path]:
    """summary.json and requests.csv under `out`."""
    import csv

    from hicache.results import write_summary_json
    from hicache.sim.runner import check_out

    check_out(out)  # an OutputError (exit 2) naming --out when it cannot be written
    paths = [out / "summary.json", out / "requests.csv"]
    write_summary_json(paths[0], summary_doc(res))
    rows = list(request_rows(res.recording, res.records, res.what_if_records))
    with paths[1].open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return paths
