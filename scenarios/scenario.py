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
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.core.router import ROUTERS
from hicache.faults import SPEC_KEYS
from hicache.scenarios.scenario_checks import ScenarioError
from hicache.scenarios.scenario_schema import (
    _TOP,
    FAULTS,
    SECTIONS,
    _not_in_workload,
    _unknown,
    parse_scenario,
    section_keys,
    workload_keys,
)
from hicache.scenarios.scenario_specs import (
    ARRIVALS,
    BASELINES,
    CACHE_SETTINGS,
    CLOSED_KINDS,
    GENERATORS,
    OVERRIDE_SOURCE,
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

# What callers import from here: the scenario's values, its schema and its loading.
__all__ = [
    "ARRIVALS",
    "BASELINES",
    "CACHE_SETTINGS",
    "CLOSED_KINDS",
    "FAULTS",
    "GENERATORS",
    "OVERRIDE_SOURCE",
    "ROUTERS",
    "SECTIONS",
    "WORKLOAD_KINDS",
    "CacheSpec",
    "ClusterSpec",
    "HardwareSpec",
    "ModelSpec",
    "RunSpec",
    "Scenario",
    "ScenarioError",
    "StorageSpec",
    "WorkloadSpec",
    "apply_overrides",
    "load_scenario",
    "override_fields",
    "parse_scenario",
    "section_keys",
    "workload_keys",
]

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
