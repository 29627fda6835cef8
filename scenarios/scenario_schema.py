"""The scenario schema: which keys each section takes, how each value is checked, and
`parse_scenario`, which turns a TOML document into a whole `Scenario` or raises `ScenarioError`
naming the file, the dotted field, the bad value and what was expected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from hicache.core.router import ROUTERS
from hicache.faults import FaultSpec, FaultSpecError
from hicache.scenarios.generators import VOCAB_MAX
from hicache.scenarios.scenario_checks import (
    Check,
    ScenarioError,
    _any_text,
    _boolean,
    _check_of,
    _distinct_names,
    _integer,
    _Invalid,
    _number,
    _one_of,
    _path,
    _show,
    _text,
    _token_range,
)
from hicache.scenarios.scenario_specs import (
    ARRIVALS,
    BASELINES,
    CACHE_SETTINGS,
    CLOSED_KINDS,
    GENERATORS,
    WORKLOAD_KINDS,
    CacheSpec,
    ClusterSpec,
    HardwareSpec,
    ModelSpec,
    RunSpec,
    Scenario,
    StorageSpec,
    WorkloadSpec,
)

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
            "front_door_running": _integer(0),
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
