"""Scenario files: one TOML file names a workload, a model, the hardware, the cluster, the cache
policies and the baselines to run, so that both drivers run the same experiment.

Loading is all or nothing: a file either becomes a whole `Scenario` of frozen values or raises
`ScenarioError`, whose message starts with the file (or `--set` for a command-line override) and
names the dotted field, the bad value and what was expected. Unknown keys are errors rather than
silently ignored, because a misspelt policy knob would otherwise run the default and look like a
result. Names the drivers resolve (model presets, GPUs, links) stay free strings here; everything
this module can check without a driver, it checks.
"""

from __future__ import annotations

import copy
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from hicache.core.config import L2_SIZE, DecodeConfig, decode_settings, l2_pages
from hicache.core.router import ROUTERS
from hicache.core.settings import Setting
from hicache.faults import SPEC_KEYS, FaultSpec, FaultSpecError
from hicache.scenarios.generators import VOCAB_MAX, AgenticLoop, SharedPrefix
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


class ScenarioError(ValueError):
    """A scenario that cannot be loaded: `source` (file or `--set`), the dotted `field` (or None
    for the file as a whole) and `detail`, which names the bad value and what was expected."""

    def __init__(self, source: str, field: str | None, detail: str) -> None:
        self.source = source
        self.field = field
        self.detail = detail
        super().__init__(f"{source}: {field}: {detail}" if field else f"{source}: {detail}")


class _Invalid(Exception):
    """A value a check rejects; the caller adds the file and the field."""


# --- value checks ---------------------------------------------------------------------------

Check = Callable[[Any], Any]


SHOWN_CHARS = 80  # of a bad value in a message: a 100 MB value must not become a 100 MB message
NAME_CHARS = 256  # names title plots and name the default results folder
PATH_CHARS = 4096  # PATH_MAX on Linux


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


def _show(value: Any) -> str:
    return f"{_short(value)} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(low: int, high: int | None = None) -> Check:
    span = f">= {low}" if high is None else f"in {low}..{high}"

    def check(value: Any) -> int:
        if not _is_int(value):
            raise _Invalid(f"expected an integer {span}, got {_show(value)}")
        if value < low or (high is not None and value > high):
            raise _Invalid(f"expected an integer {span}, got {_short(value)}")
        return value

    return check


def _number(low: float, *, above: bool = False, high: float | None = None) -> Check:
    """A finite number >= low (> low when `above`), <= high when given; ints become floats."""
    span = ("> " if above else ">= ") + f"{low:g}" + (f" and <= {high:g}" if high is not None else "")

    def check(value: Any) -> float:
        if not _is_number(value):
            raise _Invalid(f"expected a number {span}, got {_show(value)}")
        try:
            as_float = float(value)
        except OverflowError:  # an int beyond any float
            as_float = math.inf
        ok = math.isfinite(as_float) and (as_float > low if above else as_float >= low)
        if not ok or (high is not None and as_float > high):
            raise _Invalid(f"expected a finite number {span}, got {_short(value)}")
        return as_float

    return check


def _bounded(value: str, limit: int) -> str:
    if len(value) > limit:
        raise _Invalid(f"expected at most {limit:,} characters, got a string of {len(value):,}")
    return value


def _text(value: Any, limit: int = NAME_CHARS) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"expected a non-empty string, got {_show(value)}")
    return _bounded(value, limit)


def _path(value: Any) -> str:
    return _text(value, PATH_CHARS)


def _any_text(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"expected a string, got {_show(value)}")
    return _bounded(value, NAME_CHARS)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {_show(value)}")
    return value


def _one_of(choices: Sequence[str], noun: str) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            shown = _short(value) if isinstance(value, str) else _show(value)
            raise _Invalid(f"unknown {noun} {shown}; expected one of: {', '.join(choices)}")
        return value

    return check


def _token_range(value: Any) -> tuple[int, int]:
    """A 2-element array [lo, hi] of integers with 1 <= lo <= hi (inclusive)."""
    if not isinstance(value, list | tuple) or len(value) != 2 or not all(_is_int(v) for v in value):
        raise _Invalid(f"expected a range [lo, hi] of two integers, got {_show(value)}")
    if not 1 <= value[0] <= value[1]:
        raise _Invalid(f"expected a range [lo, hi] with 1 <= lo <= hi, got {list(value)!r}")
    return (value[0], value[1])


def _distinct_names(choices: Sequence[str], noun: str) -> Check:
    def check(value: Any) -> tuple[str, ...]:
        if not isinstance(value, list | tuple) or not value:
            expected = f"expected a non-empty array of {noun}s from: {', '.join(choices)}"
            raise _Invalid(f"{expected}; got {_show(value)}")
        one = _one_of(choices, noun)
        names = tuple(one(v) for v in value)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise _Invalid(f"{noun} {repeated[0]!r} is listed more than once in {list(names)!r}")
        return names

    return check


def _check_of(setting: Setting) -> Check:
    """A setting's check, from what its description says it accepts."""
    if setting.choices is not None:
        return _one_of(setting.choices, "policy")
    if setting.kind is bool:
        return _boolean
    low = 0 if setting.low is None else setting.low
    return _integer(int(low)) if setting.kind is int else _number(low)


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


# --- the schema -----------------------------------------------------------------------------

_SECTIONS: dict[str, tuple[type, dict[str, Check]]] = {
    "model": (
        ModelSpec,
        {
            "preset": _any_text,
            "name": _text,
            "layers": _integer(1),
            "q_heads": _integer(1),
            "kv_heads": _integer(1),
            "head_dim": _integer(1),
            "params": _number(0, above=True),
            "total_params": _number(0, above=True),
            "dtype_bytes": _integer(1),
            "mla_kv_lora_rank": _integer(0),
            "mla_rope_dim": _integer(0),
        },
    ),
    "hardware": (
        HardwareSpec,
        {
            "gpu": _text,
            "gpus_per_node": _integer(1),
            "mem_fraction": _number(0, above=True, high=1),
            "efficiency": _number(0, above=True, high=1),
            "host_link": _text,
            "network": _text,
            "host_bandwidth": _number(0, above=True),
            "network_bandwidth": _number(0, above=True),
            "network_latency": _number(0, above=True),
            "transfer_rate": _number(0, above=True),
            "hbm_bandwidth": _number(0, above=True),
            "flops": _number(0, above=True),
        },
    ),
    "storage": (
        StorageSpec,
        {"bandwidth": _number(0, above=True), "latency": _number(0), "capacity_tokens": _integer(0)},
    ),
    "cluster": (
        ClusterSpec,
        {
            "prefill_nodes": _integer(1),
            "decode_nodes": _integer(1),
            "router": _one_of(ROUTERS, "router"),
            "prefill_cache": _boolean,
            "max_running": _integer(1),
            "decode_step_overhead": _number(0),
            "hicache_step_overhead": _number(0),
            "tick_interval": _number(0, above=True),
            "layerwise_transfer": _boolean,
            "transfer_groups": _integer(0),
        },
    ),
    "cache": (CacheSpec, {key: _check_of(s) for key, s in CACHE_SETTINGS.items()}),
    "run": (RunSpec, {"baselines": _distinct_names(BASELINES, "baseline"), "until": _number(0)}),
}
_CUSTOM_MODEL = ("name", "layers", "q_heads", "kv_heads", "head_dim", "params")
_TOP = {"name": _text, "seed": _integer(0)}
SECTIONS = ("workload", *_SECTIONS)
FAULTS = "faults"  # an optional section, validated by `hicache.faults.FaultSpec.parse`

_WORKLOAD_COMMON = {"kind": _one_of(WORKLOAD_KINDS, "workload kind"), "tenants": _integer(1)}
_CLOSED_LOOP = {"arrivals": _one_of(ARRIVALS, "arrival mode"), "clients": _integer(0)}
_TRACE = {
    "path": _path,
    "time_scale": _number(0, above=True),
    "limit": _integer(0),
    "think_time": _number(0),
}
_GENERATOR_CHECKS: dict[str, dict[str, Check]] = {
    "multiturn": {
        "conversations": _integer(1),
        "turns": _integer(1),
        "system_prompt": _integer(0),
        "user_tokens": _token_range,
        "output_tokens": _token_range,
        "rate": _number(0, above=True),
        "think_time": _number(0),
        "vocab": _integer(2, VOCAB_MAX),
        "seed": _integer(0),
    },
    "agentic": {
        "sessions": _integer(1),
        "steps": _integer(1),
        "system_prompt": _integer(0),
        "task_tokens": _token_range,
        "tool_output_tokens": _token_range,
        "output_tokens": _token_range,
        "rate": _number(0, above=True),
        "tool_time": _number(0),
        "vocab": _integer(2, VOCAB_MAX),
        "seed": _integer(0),
    },
    "shared_prefix": {
        "groups": _integer(1),
        "prompts_per_group": _integer(1),
        "system_prompt": _integer(0),
        "question_tokens": _token_range,
        "output_tokens": _token_range,
        "rate": _number(0, above=True),
        "vocab": _integer(2, VOCAB_MAX),
        "seed": _integer(0),
    },
}


def workload_keys(kind: str) -> tuple[str, ...]:
    """The keys a [workload] table of this kind accepts."""
    specific = _TRACE if kind == "trace" else _GENERATOR_CHECKS.get(kind, {})
    closed = _CLOSED_LOOP if kind in CLOSED_KINDS else {}
    return (*_WORKLOAD_COMMON, *closed, *specific)


def section_keys(section: str) -> tuple[str, ...]:
    """The keys a section accepts (for [workload]: those of every kind)."""
    if section == "workload":
        return tuple(dict.fromkeys(k for kind in WORKLOAD_KINDS for k in workload_keys(kind)))
    return tuple(_SECTIONS[section][1])


# --- parsing --------------------------------------------------------------------------------


def _checked(check: Check, value: Any, source: str, field: str) -> Any:
    try:
        return check(value)
    except _Invalid as exc:
        raise ScenarioError(source, field, str(exc)) from None


def _unknown(source: str, field: str, known: Sequence[str], what: str = "unknown key") -> ScenarioError:
    return ScenarioError(source, field, f"{what}; expected one of: {', '.join(known)}")


def _table(doc: Mapping[str, Any], section: str, source: str) -> Mapping[str, Any]:
    table = doc.get(section, {})
    if not isinstance(table, Mapping):
        raise ScenarioError(source, section, f"expected a table [{section}], got {_show(table)}")
    return table


def _parse_section(doc: Mapping[str, Any], section: str, source: str) -> Any:
    cls, checks = _SECTIONS[section]
    table = _table(doc, section, source)
    values = {}
    for key, value in table.items():
        if key not in checks:
            raise _unknown(source, f"{section}.{key}", tuple(checks))
        values[key] = _checked(checks[key], value, source, f"{section}.{key}")
    return cls(**values)


def _parse_model(doc: Mapping[str, Any], source: str) -> ModelSpec:
    model: ModelSpec = _parse_section(doc, "model", source)
    if model.preset == "":
        for key in _CUSTOM_MODEL:
            if getattr(model, key) is None:
                raise ScenarioError(
                    source, f"model.{key}", "required for a custom geometry (model.preset is empty)"
                )
    mla = model.mla_kv_lora_rank is not None and model.mla_kv_lora_rank > 0
    if not mla and None not in (model.kv_heads, model.q_heads) and model.kv_heads > model.q_heads:
        expected = f"expected at most model.q_heads ({model.q_heads})"
        raise ScenarioError(source, "model.kv_heads", f"{expected}, got {model.kv_heads}")
    return model


def _resolve_path(value: str, source: str) -> str:
    try:
        path = Path(value).expanduser()
    except RuntimeError:  # "~name" of a user this machine does not have: literal, as in a shell
        path = Path(value)
    if not path.is_absolute():
        path = Path(source).parent / path
    return os.path.normpath(path.absolute())


def _not_in_workload(source: str, key: str, kind: str) -> ScenarioError:
    others = [k for k in WORKLOAD_KINDS if k != kind and key in workload_keys(k)]
    what = f"applies to kind {' or '.join(others)}, not {kind}" if others else "unknown key"
    return _unknown(source, f"workload.{key}", workload_keys(kind), what)


def _parse_workload(doc: Mapping[str, Any], source: str) -> WorkloadSpec:
    table = _table(doc, "workload", source)
    kind = _checked(_WORKLOAD_COMMON["kind"], table.get("kind", "multiturn"), source, "workload.kind")
    known = workload_keys(kind)
    for key in table:
        if key not in known:
            raise _not_in_workload(source, key, kind)
    checks = {**_WORKLOAD_COMMON, **_CLOSED_LOOP, **(_TRACE if kind == "trace" else _GENERATOR_CHECKS[kind])}
    values = {key: _checked(checks[key], value, source, f"workload.{key}") for key, value in table.items()}
    tenants = values.get("tenants", 1)
    loop = _closed_loop(values, kind, source)
    if kind == "trace":
        if "path" not in values:
            raise ScenarioError(
                source,
                "workload.path",
                "required for a trace workload: a .jsonl (Mooncake) or .csv (Azure) file, or a "
                "kv-cache-tester folder or .json file, relative to the scenario file",
            )
        return WorkloadSpec(
            kind,
            tenants,
            path=_resolve_path(values["path"], source),
            time_scale=values.get("time_scale", 1.0),
            limit=values.get("limit", 0),
            think_time=values.get("think_time"),
            **loop,
        )
    cls = GENERATORS[kind]
    params = {f.name: values.get(f.name, f.default) for f in attrs.fields(cls) if f.name != "seed"}
    seed = values.get("seed")
    try:
        cls(**params, seed=0 if seed is None else seed)
    except ValueError as exc:  # a constraint across parameters that the checks above miss
        raise ScenarioError(source, "workload", str(exc)) from None
    return WorkloadSpec(kind, tenants, seed=seed, params=tuple(params.items()), **loop)


def _closed_loop(values: Mapping[str, Any], kind: str, source: str) -> dict[str, Any]:
    """`arrivals` and `clients`; the keys that only a closed loop reads need one."""
    arrivals = values.get("arrivals", "open")
    needs = {"clients": values.get("clients", 0) > 0}
    if kind == "trace":
        needs["think_time"] = "think_time" in values
    if arrivals != "closed":
        for key, used in needs.items():
            if used:
                detail = 'applies only to closed-loop sessions: set workload.arrivals = "closed"'
                raise ScenarioError(source, f"workload.{key}", detail)
    return {"arrivals": arrivals, "clients": values.get("clients", 0)}


def parse_scenario(doc: Mapping[str, Any], source: str) -> Scenario:
    """A scenario from parsed TOML (or `Scenario.to_dict()` data); `source` is the file it came
    from: it starts every error message and anchors a relative trace path."""
    if not isinstance(doc, Mapping):
        raise ScenarioError(source, None, f"expected a table of sections, got {_show(doc)}")
    for key in doc:
        if key not in _TOP and key not in SECTIONS and key != FAULTS:
            raise _unknown(source, key, (*_TOP, *SECTIONS, FAULTS), "unknown key or section")
    name = _checked(_text, doc.get("name", Path(source).stem or "scenario"), source, "name")
    seed = _checked(_TOP["seed"], doc.get("seed", 0), source, "seed")
    workload = _parse_workload(doc, source)
    model = _parse_model(doc, source)
    sections = {s: _parse_section(doc, s, source) for s in ("hardware", "storage", "cluster", "cache", "run")}
    faults = None
    if FAULTS in doc:
        try:
            faults = FaultSpec.parse(doc[FAULTS], FAULTS)
        except FaultSpecError as exc:
            raise ScenarioError(source, exc.field, exc.detail) from None
    return Scenario(name, seed, workload, model, source=source, faults=faults, **sections)


# --- overrides and files --------------------------------------------------------------------


def _toml_value(raw: str) -> Any:
    """`raw` as a TOML value; text that is not valid TOML (a bare word) is taken as a string."""
    try:
        parsed = tomllib.loads(f"value = {raw}")
    except tomllib.TOMLDecodeError:
        return raw.strip()
    except (ValueError, RecursionError):  # an integer of too many digits, nesting too deep
        return raw.strip()
    return parsed["value"] if list(parsed) == ["value"] else raw.strip()


def _split_override(item: str, source: str) -> tuple[tuple[str, ...], Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ScenarioError(source, None, f"{item!r}: expected section.key=value")
    dotted, raw = item.split("=", 1)
    path = tuple(part.strip() for part in dotted.split("."))
    if len(path) > 2 or not all(path):
        raise ScenarioError(source, dotted.strip(), "expected section.key (or name, seed) before '='")
    return path, _toml_value(raw)


def _effective_kind(doc: Mapping[str, Any], parsed: Sequence[tuple[tuple[str, ...], Any]]) -> str | None:
    table = doc.get("workload", {})
    kind = table.get("kind", "multiturn") if isinstance(table, Mapping) else None
    for path, value in parsed:
        if path == ("workload", "kind"):
            kind = value
    return kind if kind in WORKLOAD_KINDS else None


def apply_overrides(
    doc: Mapping[str, Any], overrides: Sequence[str], source: str = OVERRIDE_SOURCE
) -> dict[str, Any]:
    """A copy of `doc` with `section.key=value` overrides applied (values parsed as TOML). An
    unknown section or key is an error naming it; values are checked when the result is parsed."""
    out = copy.deepcopy(dict(doc))
    parsed = [_split_override(item, source) for item in overrides]
    kind = _effective_kind(out, parsed)
    for path, value in parsed:
        field = ".".join(path)
        if len(path) == 1:
            if path[0] in SECTIONS:
                raise ScenarioError(source, field, f"is a section; set one of its keys as {field}.<key>")
            if path[0] not in _TOP:
                raise _unknown(source, field, (*_TOP, *(f"{s}.<key>" for s in SECTIONS)), "unknown key")
            out[path[0]] = value
            continue
        section, key = path
        if section not in SECTIONS and section != FAULTS:
            raise _unknown(source, section, (*SECTIONS, FAULTS), "unknown section")
        if section == FAULTS:
            if key not in SPEC_KEYS:
                raise _unknown(source, field, SPEC_KEYS)
        elif section == "workload" and kind is not None:
            if key not in workload_keys(kind):
                raise _not_in_workload(source, key, kind)
        elif key not in section_keys(section):
            raise _unknown(source, field, section_keys(section))
        table = out.setdefault(section, {})
        if isinstance(table, dict):  # otherwise the parse names the malformed section
            table[key] = value
    return out


def override_fields(overrides: Sequence[str]) -> set[str]:
    """The dotted fields that `overrides` set (for attributing errors to the command line)."""
    return {".".join(_split_override(item, OVERRIDE_SOURCE)[0]) for item in overrides}


def load_scenario(path: str | Path, overrides: Sequence[str] = ()) -> Scenario:
    """Read a scenario file, apply `--set` overrides, and validate the result as a whole."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ScenarioError(source, None, "no such scenario file") from None
    except OSError as exc:
        raise ScenarioError(source, None, f"cannot read the scenario file ({exc.strerror})") from None
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ScenarioError(source, None, f"not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        where = f"{source}:{found.group(1)}" if found else source
        raise ScenarioError(where, None, f"invalid TOML: {exc}") from None
    except (ValueError, RecursionError) as exc:  # tomllib: an integer of too many digits, deep nesting
        raise ScenarioError(source, None, f"invalid TOML: {exc}") from None
    doc = apply_overrides(doc, overrides)
    try:
        return parse_scenario(doc, source)
    except ScenarioError as exc:
        field = exc.field
        if field is not None and any(
            field == f or field.startswith((f + ".", f + "[")) for f in override_fields(overrides)
        ):
            raise ScenarioError(OVERRIDE_SOURCE, field, exc.detail) from None
        raise
