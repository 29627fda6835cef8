"""Scenario sections as frozen values: what a loaded scenario holds, section by section, and
`Scenario`, the whole experiment both drivers run. Parsing and checking them is
`scenario_schema.py`; these classes only hold the values and turn them back into TOML data.
"""

from __future__ import annotations

from typing import Any

import attrs

from hicache.core.config import L2_SIZE, DecodeConfig, decode_settings, l2_pages
from hicache.core.settings import Setting
from hicache.faults import FaultSpec
from hicache.scenarios.generators import AgenticLoop, SharedPrefix
from hicache.scenarios.multiturn import MultiTurnChat

WORKLOAD_KINDS = ("multiturn", "agentic", "shared_prefix", "trace")
GENERATORS: dict[str, type[MultiTurnChat] | type[AgenticLoop] | type[SharedPrefix]] = {
    "multiturn": MultiTurnChat,
    "agentic": AgenticLoop,
    "shared_prefix": SharedPrefix,
}
ARRIVALS = ("open", "closed")
CLOSED_KINDS = ("multiturn", "agentic", "trace")  # the kinds whose requests follow one another
BASELINES = ("no_decode_cache", "l1", "l1_l2", "l1_l2_l3")
OVERRIDE_SOURCE = "--set"


# --- the sections ---------------------------------------------------------------------------


@attrs.frozen(slots=True)
class WorkloadSpec:
    """What to replay. Generator kinds keep every generator parameter, resolved against the
    generator's defaults, in `params`; a trace keeps its (resolved) path."""

    kind: str = "multiturn"
    tenants: int = 1
    path: str = ""
    time_scale: float = 1.0
    limit: int = 0
    seed: int | None = None  # None: the scenario's seed
    params: tuple[tuple[str, Any], ...] = ()
    # "closed": a session's next request is sent a pause after its previous one is answered
    # (benchmark clients); "open": every request arrives at a time fixed in advance.
    arrivals: str = "open"
    clients: int = 0  # closed loop: at most this many sessions open at once; 0: no limit
    think_time: float | None = None  # closed-loop traces: a fixed pause; None: the trace's gaps

    @property
    def closed(self) -> bool:
        return self.arrivals == "closed"

    def generator_params(self) -> dict[str, Any]:
        return dict(self.params)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "tenants": self.tenants}
        if self.closed:  # open arrivals, the default, are left out: older results stay equal
            out.update(arrivals=self.arrivals, clients=self.clients)
        if self.kind == "trace":
            out.update(path=self.path, time_scale=self.time_scale, limit=self.limit)
            if self.think_time is not None:
                out["think_time"] = self.think_time
        else:
            out.update({k: list(v) if isinstance(v, tuple) else v for k, v in self.params})
            if self.seed is not None:
                out["seed"] = self.seed
        return out


@attrs.frozen(slots=True)
class ModelSpec:
    """A preset name plus overrides, or (preset "") a custom geometry. `params` are the active
    parameters per token."""

    preset: str = "qwen2.5-32b"
    name: str | None = None
    layers: int | None = None
    q_heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    params: float | None = None
    total_params: float | None = None
    dtype_bytes: int | None = None
    mla_kv_lora_rank: int | None = None
    mla_rope_dim: int | None = None

    def overrides(self) -> dict[str, Any]:
        """The geometry fields this scenario sets (all but `preset`)."""
        return {k: v for k, v in attrs.asdict(self).items() if k != "preset" and v is not None}


@attrs.frozen(slots=True)
class HardwareSpec:
    """Every node's GPUs and links by preset name (the driver resolves them), with optional
    figures that replace the preset's."""

    gpu: str = "h100"
    gpus_per_node: int = 8
    mem_fraction: float = 0.9
    efficiency: float = 0.5
    host_link: str = "pcie5"
    network: str = "rdma400"
    host_bandwidth: float | None = None  # bytes/s per GPU
    network_bandwidth: float | None = None  # bytes/s per GPU
    network_latency: float | None = None  # s
    transfer_rate: float | None = None  # bytes/s of one P->D transfer (its connection); None: the link's
    hbm_bandwidth: float | None = None  # bytes/s
    flops: float | None = None  # dense FLOP/s per GPU


@attrs.frozen(slots=True)
class StorageSpec:
    """The L3 that all nodes share, so its bandwidth is contended."""

    bandwidth: float = 10e9  # bytes/s, shared by all nodes
    latency: float = 0.002  # s per operation
    capacity_tokens: int = 0  # 0: unbounded


@attrs.frozen(slots=True)
class ClusterSpec:
    """How many nodes of each role, how requests reach them, and the decode loop's costs."""

    prefill_nodes: int = 1
    decode_nodes: int = 1
    router: str = "round_robin"
    prefill_cache: bool = True
    max_running: int = 256
    decode_step_overhead: float = 0.005
    # Added to every decode step of a node with a host or storage tier (l1_l2, l1_l2_l3): the
    # per-step event polling and collectives of a hierarchical cache. SGLang measured about
    # 150 us per all-reduce, four per step before sgl-project/sglang#30511 merged them into one.
    hicache_step_overhead: float = 0.0
    tick_interval: float = 0.002
    # P->D transfers leave layer group by layer group while prefill computes them, as SGLang
    # streams KV; false: once prefill has ended. transfer_groups = 0: one group per model layer.
    layerwise_transfer: bool = True
    transfer_groups: int = 0
    # A front door before the decode nodes, as `hicache serve` has (0: none): at most this many
    # requests at the decode nodes, together holding at most their L1 (a request counts its
    # prompt and min(output, decode_reserve_tokens); one alone always fits); the others wait
    # at the door in arrival order, their pages unmatched and unlocked until they go in.
    front_door_running: int = 0


# [cache]: every `DecodeConfig` setting whose scenario key is `cache.<key>`, described once, in
# the core (`hicache.core.settings`), plus the tier sizes in tokens. The order is the table's
# since the first release (what `summary.json` records).
L1_TOKENS = Setting(
    name="l1_tokens",
    default=0,
    kind=int,
    low=0,
    help="L1 tokens; 0: what HBM holds after the weights (the simulator), or the runtime's default",
    scenario="cache.l1_tokens",
    unit="tokens",
    group=None,
)


def _cache_settings() -> dict[str, Setting]:
    core = {
        key: s
        for s in (*decode_settings().values(), *L2_SIZE.values())
        if (key := s.scenario_key("cache")) is not None
    }
    first = {"page_size": core.pop("page_size"), "l1_tokens": L1_TOKENS}
    first |= {key: core.pop(key) for key in ("hicache_ratio", "l2_tokens")}
    return first | core


CACHE_SETTINGS: dict[str, Setting] = _cache_settings()  # [cache] key -> its setting
# The [cache] keys that are `DecodeConfig` fields (the rest size the tiers: `CacheSpec.l2_pages_for`).
CACHE_CORE_KEYS = tuple(k for k, s in CACHE_SETTINGS.items() if s.name in attrs.fields_dict(DecodeConfig))


@attrs.frozen(slots=True, these={k: attrs.field(default=s.default) for k, s in CACHE_SETTINGS.items()})
class CacheSpec:
    """The decode node's tier sizes (tokens) and the core's policies (`DecodeConfig`): one field
    per [cache] key of `CACHE_SETTINGS` (`page_size`, `l1_tokens`, `hicache_ratio`, `l2_tokens`,
    `eviction`, ...), each defaulting as the core does. Policies hold their names."""

    def l2_pages_for(self, l1_pages: int) -> int:
        """L2 pages beside an L1 of `l1_pages` (`hicache.core.config.l2_pages`)."""
        return l2_pages(l1_pages, self.page_size, hicache_ratio=self.hicache_ratio, l2_tokens=self.l2_tokens)

    def decode_config(self, l1_pages: int, l2_pages: int, **driver: Any) -> DecodeConfig:
        """The core's configuration; the driver adds what it knows (`storage`, `tp_size`, the
        bandwidth estimates)."""
        policy = {CACHE_SETTINGS[k].name: getattr(self, k) for k in CACHE_CORE_KEYS}
        return DecodeConfig(l1_pages=l1_pages, l2_pages=l2_pages, **policy, **driver)


@attrs.frozen(slots=True)
class RunSpec:
    """The baselines to compare in one run, and how much of the workload to replay."""

    baselines: tuple[str, ...] = BASELINES
    until: float = 0.0  # seconds of arrivals; 0: the whole workload


@attrs.frozen(slots=True)
class Scenario:
    """A whole experiment; `to_dict` records exactly what ran."""

    name: str
    seed: int = 0
    workload: WorkloadSpec = WorkloadSpec()
    model: ModelSpec = ModelSpec()
    hardware: HardwareSpec = HardwareSpec()
    storage: StorageSpec = StorageSpec()
    cluster: ClusterSpec = ClusterSpec()
    cache: CacheSpec = CacheSpec()
    run: RunSpec = RunSpec()
    faults: FaultSpec | None = None  # [faults]: injected into the decode nodes' operations
    source: str = attrs.field(default="", eq=False)  # where it was loaded from, for messages

    @property
    def workload_seed(self) -> int:
        return self.seed if self.workload.seed is None else self.workload.seed

    def to_dict(self) -> dict[str, Any]:
        """Plain data (TOML types) that `parse_scenario` turns back into this scenario."""
        out: dict[str, Any] = {"name": self.name, "seed": self.seed, "workload": self.workload.to_dict()}
        for section in ("model", "hardware", "storage", "cluster", "cache", "run"):
            values = attrs.asdict(getattr(self, section))
            out[section] = {
                k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None
            }
        if self.faults is not None:
            out["faults"] = self.faults.to_dict()
        return out
