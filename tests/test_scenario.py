"""Scenario files: the shipped files, overrides, errors that name the file and field, building."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import attrs
import hypothesis.strategies as st
import numpy as np
import pytest
from builders import examples
from hypothesis import given, settings

from hicache.core.config import PREFETCH_POLICIES, PROMISE_POLICIES, RETRACT_POLICIES
from hicache.core.eviction import EVICTION_POLICIES
from hicache.core.write_policy import WritePolicy
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import (
    ARRIVALS,
    BASELINES,
    CLOSED_KINDS,
    GENERATORS,
    ROUTERS,
    SECTIONS,
    WORKLOAD_KINDS,
    Scenario,
    ScenarioError,
    apply_overrides,
    load_scenario,
    parse_scenario,
    section_keys,
    workload_keys,
)
from hicache.scenarios.traces import TraceError

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces"
SHIPPED = sorted(p.stem for p in (ROOT / "scenarios").glob("*.toml"))  # every file that ships
SOURCE = "fuzz/scenario.toml"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- the shipped files ----------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_scenario_loads_round_trips_and_builds(name: str) -> None:
    path = ROOT / "scenarios" / f"{name}.toml"
    scenario = load_scenario(path)
    assert scenario.name == name
    assert parse_scenario(scenario.to_dict(), str(path)) == scenario
    config = scenario.cache.decode_config(l1_pages=1000, l2_pages=2000, storage=True)
    assert config.promise == scenario.cache.promise and config.page_size == scenario.cache.page_size
    if scenario.workload.kind == "trace":
        if not TRACES.exists():
            pytest.skip(f"{TRACES} is not beside this checkout")
        assert Path(scenario.workload.path).resolve().is_relative_to(TRACES.resolve())
    items = build_workload(scenario)
    assert items
    assert [i.arrival for i in items] == sorted(i.arrival for i in items)
    assert len({i.id for i in items}) == len(items)


def test_demo_is_a_few_hundred_requests_whose_context_outgrows_l1_and_l2() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "demo.toml")
    assert scenario.workload.kind == "multiturn" and scenario.cluster.prefill_nodes == 1
    items = build_workload(scenario)
    assert 300 <= len(items) <= 400
    # Distinct tokens: the shared system prompt once, plus each conversation's own turns.
    system = scenario.workload.generator_params()["system_prompt"]
    last: dict[str, Any] = {}
    for item in items:
        if item.turn >= last.get(item.session, item).turn:
            last[item.session] = item
    distinct = system + sum(i.prompt_len + i.output_len - system for i in last.values())
    l1 = scenario.cache.l1_tokens
    assert (
        l1 > 0
        and scenario.cache.l2_pages_for(l1 // scenario.cache.page_size) * scenario.cache.page_size < distinct
    )
    assert scenario.hardware.network_bandwidth is not None


def test_mooncake_scenario_reads_the_whole_trace() -> None:
    if not TRACES.exists():
        pytest.skip(f"{TRACES} is not beside this checkout")
    scenario = load_scenario(ROOT / "scenarios" / "mooncake_conversation.toml")
    assert (scenario.cluster.prefill_nodes, scenario.cluster.decode_nodes) == (4, 4)
    assert scenario.run.baselines == BASELINES
    items = build_workload(scenario)
    assert len(items) == 12_031 and items[0].blocks is not None


# --- defaults and the schema ------------------------------------------------------------------


def test_empty_document_is_every_default() -> None:
    scenario = parse_scenario({}, "some/dir/plain.toml")
    assert scenario == Scenario(
        "plain", workload=parse_scenario({"workload": {"kind": "multiturn"}}, "x").workload
    )
    assert scenario.workload.kind == "multiturn" and scenario.workload.tenants == 1
    assert scenario.model.preset == "qwen2.5-32b" and scenario.cluster.router == "round_robin"
    assert scenario.cache.l2_pages_for(1000) == 2000 and scenario.run.until == 0.0
    assert scenario.run.baselines == ("no_decode_cache", "l1", "l1_l2", "l1_l2_l3")


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_every_generator_parameter_can_be_set(kind: str) -> None:
    names = tuple(f.name for f in attrs.fields(GENERATORS[kind]))
    closed = ("arrivals", "clients") if kind in CLOSED_KINDS else ()
    assert workload_keys(kind) == ("kind", "tenants", *closed, *names)
    defaults = {f.name: f.default for f in attrs.fields(GENERATORS[kind]) if f.name != "seed"}
    assert parse_scenario({"workload": {"kind": kind}}, "x").workload.generator_params() == defaults


def test_cache_policy_names_are_the_cores() -> None:
    choices = {
        "eviction": tuple(EVICTION_POLICIES),
        "write_policy": tuple(p.value for p in WritePolicy),
        "promise": PROMISE_POLICIES,
        "prefetch_policy": PREFETCH_POLICIES,
        "retract_policy": RETRACT_POLICIES,
    }
    for key, names in choices.items():
        for name in names:
            cache = parse_scenario({"cache": {key: name}}, "x").cache
            assert getattr(cache.decode_config(l1_pages=10, l2_pages=0), key) == name


def test_custom_geometry_needs_its_fields() -> None:
    custom = {"preset": "", "name": "tiny", "layers": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 16}
    with pytest.raises(ScenarioError, match=r"^x\.toml: model\.params: required"):
        parse_scenario({"model": custom}, "x.toml")
    model = parse_scenario({"model": {**custom, "params": 1e6}}, "x.toml").model
    assert model.overrides() == {
        "name": "tiny",
        "layers": 2,
        "q_heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "params": 1e6,
    }
    with pytest.raises(ScenarioError, match=r"^x\.toml: model\.kv_heads: expected at most model\.q_heads"):
        parse_scenario({"model": {"q_heads": 4, "kv_heads": 8}}, "x.toml")


def test_trace_path_is_relative_to_the_scenario_file(tmp_path: Path) -> None:
    doc = {"workload": {"kind": "trace", "path": "../traces/t.jsonl"}}
    scenario = parse_scenario(doc, str(tmp_path / "scenarios" / "s.toml"))
    assert scenario.workload.path == str(tmp_path / "traces" / "t.jsonl")
    assert parse_scenario({"workload": {"kind": "trace", "path": "/abs/t.csv"}}, "s.toml").workload.path == (
        "/abs/t.csv"
    )
    with pytest.raises(ScenarioError, match=r"^s\.toml: workload\.path: required for a trace workload"):
        parse_scenario({"workload": {"kind": "trace"}}, "s.toml")


# --- errors name the file, the field, the value and what was expected --------------------------


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"cache": {"promise": "eagre"}},
            "x.toml: cache.promise: unknown policy 'eagre'; expected one of: eager, confirmed, adaptive",
        ),
        ({"cache": {"page_size": 0}}, "x.toml: cache.page_size: expected an integer >= 1, got 0"),
        (
            {"cache": {"page_size": 64.0}},
            "x.toml: cache.page_size: expected an integer >= 1, got 64.0 (float)",
        ),
        (
            {"hardware": {"mem_fraction": 1.5}},
            "x.toml: hardware.mem_fraction: expected a finite number > 0 and <= 1",
        ),
        (
            {"storage": {"bandwidth": math.inf}},
            "x.toml: storage.bandwidth: expected a finite number > 0, got inf",
        ),
        (
            {"cluster": {"prefill_cache": 1}},
            "x.toml: cluster.prefill_cache: expected true or false, got 1 (int)",
        ),
        (
            {"cluster": {"router": "random"}},
            "x.toml: cluster.router: unknown router 'random'; expected one of:",
        ),
        ({"run": {"baselines": []}}, "x.toml: run.baselines: expected a non-empty array of baselines"),
        ({"run": {"baselines": ["l1", "l2"]}}, "x.toml: run.baselines: unknown baseline 'l2'"),
        ({"workload": {"kind": "chat"}}, "x.toml: workload.kind: unknown workload kind 'chat'"),
        ({"workload": {"user_tokens": [64]}}, "x.toml: workload.user_tokens: expected a range [lo, hi]"),
        (
            {"workload": {"steps": 3}},
            "x.toml: workload.steps: applies to kind agentic, not multiturn; expected",
        ),
        ({"workload": {"kind": "trace", "path": "t", "turns": 3}}, "x.toml: workload.turns: applies to kind"),
        ({"cache": {"promis": "eager"}}, "x.toml: cache.promis: unknown key; expected one of: page_size,"),
        ({"caches": {}}, "x.toml: caches: unknown key or section; expected one of: name, seed, workload,"),
        ({"cache": 3}, "x.toml: cache: expected a table [cache], got 3 (int)"),
        ({"seed": -1}, "x.toml: seed: expected an integer >= 0, got -1"),
        ({"name": ""}, "x.toml: name: expected a non-empty string, got '' (str)"),
    ],
)
def test_bad_values_are_named(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(doc, "x.toml")
    assert str(info.value).startswith(message)


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.toml", 'name = "x"\n[cache]\npromise = eager\n')
    with pytest.raises(ScenarioError, match=rf"^{re.escape(str(path))}:3: invalid TOML"):
        load_scenario(path)


def test_missing_or_unreadable_scenario_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"nope\.toml: no such scenario file"):
        load_scenario(tmp_path / "nope.toml")
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(ScenarioError, match=r"latin1\.toml: not UTF-8"):
        load_scenario(path)


# --- overrides ------------------------------------------------------------------------------


def test_overrides_are_typed_toml_values_or_bare_strings() -> None:
    doc = {"cache": {"promise": "eager"}, "workload": {"turns": 3}}
    out = apply_overrides(
        doc,
        [
            "cache.hicache_ratio=4",
            'run.baselines=["l1","l1_l2"]',
            'cluster.router="cache_aware"',
            "cache.promise=adaptive",
            "cluster.prefill_cache=false",
            "workload.user_tokens = [8, 16]",
            "name=a=b",
            "seed=3",
        ],
        "--set",
    )
    assert out["cache"] == {"promise": "adaptive", "hicache_ratio": 4}
    assert out["run"] == {"baselines": ["l1", "l1_l2"]}
    assert out["cluster"] == {"router": "cache_aware", "prefill_cache": False}
    assert out["workload"] == {"turns": 3, "user_tokens": [8, 16]}
    assert (out["name"], out["seed"]) == ("a=b", 3)
    assert doc == {"cache": {"promise": "eager"}, "workload": {"turns": 3}}  # the input is kept
    scenario = parse_scenario(out, "x.toml")
    assert scenario.cache.hicache_ratio == 4.0 and scenario.run.baselines == ("l1", "l1_l2")


def test_overrides_follow_the_workload_kind_they_set() -> None:
    out = apply_overrides({}, ["workload.steps=3", "workload.kind=agentic"], "--set")
    assert parse_scenario(out, "x").workload.generator_params()["steps"] == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cache.foo=1", "--set: cache.foo: unknown key; expected one of: page_size,"),
        ("foo.bar=1", "--set: foo: unknown section; expected one of: workload, model,"),
        ("cache=1", "--set: cache: is a section; set one of its keys as cache.<key>"),
        ("nme=x", "--set: nme: unknown key; expected one of: name, seed, workload.<key>,"),
        ("cache.promise", "--set: 'cache.promise': expected section.key=value"),
        ("a.b.c=1", "--set: a.b.c: expected section.key"),
        ("workload.steps=2", "--set: workload.steps: applies to kind agentic, not multiturn"),
    ],
)
def test_bad_override_names_the_field(override: str, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        apply_overrides({}, [override], "--set")
    assert str(info.value).startswith(message)


def test_bad_override_value_is_blamed_on_the_command_line(tmp_path: Path) -> None:
    path = write(tmp_path / "s.toml", '[cache]\npromise = "eagre"\n')
    with pytest.raises(
        ScenarioError, match=rf"^{re.escape(str(path))}: cache\.promise: unknown policy 'eagre'"
    ):
        load_scenario(path)
    with pytest.raises(ScenarioError, match=r"^--set: cache\.promise: unknown policy 'nope'"):
        load_scenario(path, ["cache.promise=nope"])
    assert load_scenario(path, ["cache.promise=confirmed"]).cache.promise == "confirmed"


# --- property tests: every bad value is a ScenarioError naming the file and field ---------------

TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=8)
NOT_STR = st.one_of(
    st.integers(-5, 5), st.floats(allow_nan=True), st.booleans(), st.lists(st.integers(0, 3), max_size=2)
)
NOT_NUMBER = st.one_of(
    TEXT, st.booleans(), st.lists(st.integers(0, 3), max_size=2), st.dictionaries(TEXT, TEXT, max_size=1)
)
NOT_INT = st.one_of(NOT_NUMBER, st.floats(allow_nan=True, allow_infinity=True))


@attrs.frozen
class Spec:
    valid: st.SearchStrategy[Any]
    invalid: st.SearchStrategy[Any]


def ints(low: int, high: int | None = None) -> Spec:
    out = st.integers(max_value=low - 1)
    if high is not None:
        out |= st.integers(min_value=high + 1)
    return Spec(st.integers(low, high or 2**40), st.one_of(out, NOT_INT))


def numbers(low: float, *, above: bool = False, high: float | None = None) -> Spec:
    inside = st.floats(low, high if high is not None else 1e15, exclude_min=above)
    whole = st.integers(math.ceil(low) + int(above), int(min(high or 10**6, 10**6)))
    below = st.floats(max_value=low).filter(lambda x: x <= low if above else x < low)
    bad = st.one_of(below, st.sampled_from([math.nan, math.inf]))
    if high is not None:
        bad |= st.floats(min_value=high, exclude_min=True)
    return Spec(st.one_of(inside, whole), st.one_of(bad, NOT_NUMBER))


def choice(names: tuple[str, ...]) -> Spec:
    return Spec(st.sampled_from(names), st.one_of(TEXT.filter(lambda s: s not in names), NOT_STR))


NAME = Spec(TEXT.filter(bool), st.one_of(st.just(""), NOT_STR))
FREE = Spec(TEXT.filter(bool), NOT_STR)
BOOL = Spec(st.booleans(), st.one_of(st.integers(0, 1), TEXT, st.floats()))
RANGE = Spec(
    st.tuples(st.integers(1, 10**6), st.integers(1, 10**6)).map(lambda t: [min(t), max(t)]),
    st.one_of(
        st.tuples(st.integers(2, 100), st.integers(1, 100)).filter(lambda t: t[0] > t[1]).map(list),
        st.tuples(st.integers(max_value=0), st.integers(1, 10)).map(list),
        st.lists(st.integers(1, 10), max_size=3).filter(lambda v: len(v) != 2),
        st.lists(st.one_of(st.floats(), TEXT), min_size=2, max_size=2),
        NOT_NUMBER.filter(lambda v: not isinstance(v, list)),
    ),
)
BASELINE_LISTS = Spec(
    st.lists(st.sampled_from(BASELINES), min_size=1, unique=True),
    st.one_of(
        st.just([]),
        st.sampled_from(BASELINES).map(lambda b: [b, b]),
        st.lists(TEXT.filter(lambda s: s not in BASELINES), min_size=1, max_size=2),
        NOT_STR.filter(lambda v: v != []),
    ),
)
COUNT, SIZE = ints(1), ints(0)

FIELDS: dict[str, Spec] = {
    "name": NAME,
    "seed": SIZE,
    "workload.kind": Spec(st.just("multiturn"), choice(WORKLOAD_KINDS).invalid),
    "workload.tenants": COUNT,
    "workload.arrivals": Spec(st.just("closed"), choice(ARRIVALS).invalid),
    "workload.clients": SIZE,
    "workload.conversations": COUNT,
    "workload.turns": COUNT,
    "workload.system_prompt": SIZE,
    "workload.user_tokens": RANGE,
    "workload.output_tokens": RANGE,
    "workload.rate": numbers(0, above=True),
    "workload.think_time": numbers(0),
    "workload.vocab": ints(2, 2**31),
    "workload.seed": SIZE,
    "workload.sessions": COUNT,
    "workload.steps": COUNT,
    "workload.task_tokens": RANGE,
    "workload.tool_output_tokens": RANGE,
    "workload.tool_time": numbers(0),
    "workload.groups": COUNT,
    "workload.prompts_per_group": COUNT,
    "workload.question_tokens": RANGE,
    "workload.path": NAME,
    "workload.time_scale": numbers(0, above=True),
    "workload.limit": SIZE,
    "model.preset": FREE,
    "model.name": NAME,
    **{f"model.{k}": COUNT for k in ("layers", "q_heads", "kv_heads", "head_dim", "dtype_bytes")},
    "model.params": numbers(0, above=True),
    "model.total_params": numbers(0, above=True),
    "model.mla_kv_lora_rank": SIZE,
    "model.mla_rope_dim": SIZE,
    "hardware.gpu": NAME,
    "hardware.gpus_per_node": COUNT,
    "hardware.mem_fraction": numbers(0, above=True, high=1),
    "hardware.efficiency": numbers(0, above=True, high=1),
    "hardware.host_link": NAME,
    "hardware.network": NAME,
    **{
        f"hardware.{k}": numbers(0, above=True)
        for k in (
            "host_bandwidth",
            "network_bandwidth",
            "network_latency",
            "transfer_rate",
            "hbm_bandwidth",
            "flops",
        )
    },
    "storage.bandwidth": numbers(0, above=True),
    "storage.latency": numbers(0),
    "storage.capacity_tokens": SIZE,
    "cluster.prefill_nodes": COUNT,
    "cluster.decode_nodes": COUNT,
    "cluster.router": choice(ROUTERS),
    "cluster.prefill_cache": BOOL,
    "cluster.max_running": COUNT,
    "cluster.decode_step_overhead": numbers(0),
    "cluster.hicache_step_overhead": numbers(0),
    "cluster.tick_interval": numbers(0, above=True),
    "cluster.layerwise_transfer": BOOL,
    "cluster.transfer_groups": SIZE,
    "cluster.front_door_running": SIZE,
    "cache.page_size": COUNT,
    "cache.l1_tokens": SIZE,
    "cache.hicache_ratio": numbers(0),
    "cache.l2_tokens": SIZE,
    "cache.eviction": choice(tuple(EVICTION_POLICIES)),
    "cache.write_policy": choice(tuple(p.value for p in WritePolicy)),
    "cache.promise": choice(PROMISE_POLICIES),
    "cache.prefetch_policy": choice(PREFETCH_POLICIES),
    "cache.prefetch_threshold_tokens": SIZE,
    "cache.prefetch_timeout_base": numbers(0),
    "cache.prefetch_timeout_per_ki_token": numbers(0),
    "cache.prefetch_timeout_max": numbers(0),
    "cache.load_batches_in_flight": COUNT,
    "cache.decode_reserve_tokens": SIZE,
    "cache.transfer_retries": SIZE,
    "cache.transfer_backoff_s": numbers(0),
    "cache.transfer_backoff_max_s": numbers(0),
    "cache.retract_policy": choice(RETRACT_POLICIES),
    "run.baselines": BASELINE_LISTS,
    "run.until": numbers(0),
}
# Workload keys of a kind other than the default multi-turn chat, and the table they need.
KIND_OF = {
    **{
        f"workload.{k}": {"kind": "agentic"}
        for k in ("sessions", "steps", "task_tokens", "tool_output_tokens")
    },
    "workload.tool_time": {"kind": "agentic"},
    **{
        f"workload.{k}": {"kind": "shared_prefix"} for k in ("groups", "prompts_per_group", "question_tokens")
    },
    **{f"workload.{k}": {"kind": "trace", "path": "t.jsonl"} for k in ("path", "time_scale", "limit")},
    "workload.clients": {"arrivals": "closed"},  # a client cap means nothing to open arrivals
}
# Fields whose valid values never interact with another field's (extras of a fuzzed document).
INDEPENDENT = sorted(
    f
    for f in FIELDS
    if not f.startswith("workload.") and f not in ("model.preset", "model.q_heads", "model.kv_heads")
)


def test_the_fuzzed_fields_are_the_schema() -> None:
    known = {"name", "seed"} | {f"{s}.{k}" for s in SECTIONS for k in section_keys(s)}
    assert set(FIELDS) == known
    assert WORKLOAD_KINDS == ("multiturn", "agentic", "shared_prefix", "trace")


def place(doc: dict[str, Any], field: str, value: Any) -> None:
    if "." not in field:
        doc[field] = value
        return
    section, key = field.split(".")
    table = doc.setdefault(section, {})
    table.update({k: v for k, v in KIND_OF.get(field, {}).items() if k != key})
    table[key] = value


def toml_value(value: Any) -> str:
    """`value` written as a TOML value (for `--set`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


@st.composite
def valid_documents(draw: st.DrawFn, exclude: str = "") -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for field in draw(st.lists(st.sampled_from(INDEPENDENT), max_size=6, unique=True)):
        if field != exclude:
            place(doc, field, draw(FIELDS[field].valid))
    return doc


@st.composite
def bad_documents(draw: st.DrawFn) -> tuple[dict[str, Any], str, list[str]]:
    """A valid document with one bad field: a wrong type, a value out of range or an unknown
    key. Returns the document, the dotted field and the same change as `--set` overrides."""
    field = draw(st.sampled_from(sorted(FIELDS)))
    doc = draw(valid_documents(exclude=field))
    if draw(st.booleans()):
        value = draw(FIELDS[field].invalid)
    else:  # an unknown key in the same section (or at the top)
        section = field.split(".")[0] if "." in field else ""
        known = {"name", "seed", *SECTIONS} if not section else set(section_keys(section))
        key = draw(st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True).filter(lambda k: k not in known))
        field, value = (f"{section}.{key}" if section else key), draw(FIELDS[field].valid)
    place(doc, field, value)
    sets = [f"{field.split('.')[0]}.{k}={toml_value(v)}" for k, v in KIND_OF.get(field, {}).items()]
    return doc, field, [*sets, f"{field}={toml_value(value)}"]


@settings(max_examples=examples(400), deadline=None)
@given(bad_documents())
def test_every_bad_field_is_a_scenario_error_naming_file_and_field(case: tuple[dict, str, list[str]]) -> None:
    doc, field, _ = case
    with pytest.raises(ScenarioError) as info:
        parse_scenario(doc, SOURCE)
    assert str(info.value).startswith(f"{SOURCE}: {field}: ")
    assert info.value.field == field


@settings(max_examples=examples(150), deadline=None)
@given(bad_documents())
def test_every_bad_override_is_a_scenario_error_naming_the_field(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[dict, str, list[str]]
) -> None:
    _, field, overrides = case
    base = tmp_path_factory.getbasetemp() / "base.toml"
    if not base.exists():
        write(base, 'name = "base"\n')
    with pytest.raises(ScenarioError) as info:
        load_scenario(base, overrides)
    assert str(info.value).startswith(f"--set: {field}: ")


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_valid_documents_round_trip(data: st.DataObject) -> None:
    doc = data.draw(valid_documents())
    kind = data.draw(st.sampled_from(WORKLOAD_KINDS))
    for field in FIELDS:
        if (
            field.startswith("workload.")
            and field.split(".")[1] in workload_keys(kind)
            and data.draw(st.booleans())
        ):
            place(doc, field, data.draw(FIELDS[field].valid))
    doc.setdefault("workload", {})["kind"] = kind
    if kind == "trace":
        doc["workload"].setdefault("path", "t.jsonl")
        if "think_time" in doc["workload"]:  # a trace's pause is for closed-loop sessions only
            doc["workload"]["arrivals"] = "closed"
    try:
        scenario = parse_scenario(doc, SOURCE)
    except ScenarioError as exc:  # only the generators' own cross-parameter checks may refuse
        pytest.fail(f"a valid document was refused: {exc}")
    assert parse_scenario(scenario.to_dict(), SOURCE) == scenario
    plain = scenario.to_dict()
    for section, table in doc.items():
        if not isinstance(table, dict):
            assert plain[section] == table
            continue
        for key, value in table.items():
            if key != "path":
                assert plain[section][key] == value


@settings(max_examples=examples(300), deadline=None)
@given(
    st.sampled_from(sorted(FIELDS)),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), TEXT),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=2),
        max_leaves=6,
    ),
)
def test_any_value_anywhere_loads_or_is_a_scenario_error(field: str, value: Any) -> None:
    doc: dict[str, Any] = {}
    place(doc, field, value)
    try:
        parse_scenario(doc, SOURCE)
    except ScenarioError as exc:
        assert str(exc).startswith(f"{SOURCE}: ")


# --- building -------------------------------------------------------------------------------


def mooncake(tmp_path: Path, n: int = 5) -> Path:
    lines = [
        json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 4, "hash_ids": [0, 1 + i]})
        for i in range(n)
    ]
    return write(tmp_path / "t.jsonl", "\n".join(lines) + "\n")


def test_trace_limit_until_and_time_scale(tmp_path: Path) -> None:
    mooncake(tmp_path)
    doc = {
        "workload": {"kind": "trace", "path": "t.jsonl", "time_scale": 0.5, "limit": 4},
        "run": {"until": 1.2},
    }
    items = build_workload(parse_scenario(doc, str(tmp_path / "s.toml")))
    assert [(i.id, i.arrival) for i in items] == [("r0", 0.0), ("r1", 0.5), ("r2", 1.0)]
    assert all(i.tenant is None and i.blocks is not None for i in items)
    doc["workload"].update(limit=2)
    assert len(build_workload(parse_scenario(doc, str(tmp_path / "s.toml")))) == 2


def test_kv_cache_tester_time_scale_is_applied(tmp_path: Path) -> None:
    folder = tmp_path / "sessions"
    folder.mkdir()
    session = {"id": "a", "block_size": 64, "requests": [{"t": 0, "in": 64, "out": 1, "hash_ids": [5]}]}
    session["requests"].append({"t": 10, "in": 128, "out": 1, "hash_ids": [5, 6]})
    write(folder / "a.json", json.dumps(session))
    doc = {"workload": {"kind": "trace", "path": "sessions", "time_scale": 0.25}}
    items = build_workload(parse_scenario(doc, str(tmp_path / "s.toml")))
    assert [(i.arrival, i.session, i.turn) for i in items] == [(0.0, "a", 0), (2.5, "a", 1)]


def test_missing_trace_is_a_scenario_error_and_bad_trace_a_trace_error(tmp_path: Path) -> None:
    doc = {"workload": {"kind": "trace", "path": "absent.jsonl"}}
    with pytest.raises(ScenarioError, match=r"s\.toml: workload\.path: no such file or directory"):
        build_workload(parse_scenario(doc, str(tmp_path / "s.toml")))
    write(
        tmp_path / "bad.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}\n'
    )
    doc = {"workload": {"kind": "trace", "path": "bad.jsonl"}}
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: field 'hash_ids' has 1 ids"):
        build_workload(parse_scenario(doc, str(tmp_path / "s.toml")))


@settings(max_examples=examples(25), deadline=None)
@given(tenants=st.integers(1, 4), kind=st.sampled_from(["multiturn", "agentic", "shared_prefix"]))
def test_generated_sessions_spread_over_tenants(tenants: int, kind: str) -> None:
    small = {
        "multiturn": {"conversations": 6, "turns": 3, "system_prompt": 64, "user_tokens": [8, 16]},
        "agentic": {"sessions": 6, "steps": 3, "system_prompt": 64, "tool_output_tokens": [8, 16]},
        "shared_prefix": {"groups": 6, "prompts_per_group": 3, "system_prompt": 64},
    }[kind]
    doc = {"workload": {"kind": kind, "tenants": tenants, **small, "output_tokens": [4, 8]}}
    items = build_workload(parse_scenario(doc, "s.toml"))
    assert len(items) == 18
    assert [i.arrival for i in items] == sorted(i.arrival for i in items)
    first: list[str] = []
    tenant_of: dict[str, str | None] = {}
    for item in items:
        if item.session not in tenant_of:
            first.append(item.session)
        assert tenant_of.setdefault(item.session, item.tenant) == item.tenant
    expected = [None if tenants == 1 else f"t{k % tenants}" for k in range(len(first))]
    assert [tenant_of[s] for s in first] == expected


def test_trace_requests_without_sessions_are_sessions_of_their_own(tmp_path: Path) -> None:
    mooncake(tmp_path)
    doc = {"workload": {"kind": "trace", "path": "t.jsonl", "tenants": 2}}
    items = build_workload(parse_scenario(doc, str(tmp_path / "s.toml")))
    assert [i.tenant for i in items] == ["t0", "t1", "t0", "t1", "t0"]


def test_the_workload_seed_overrides_the_scenario_seed() -> None:
    def tokens(doc: dict[str, Any]) -> list[bytes]:
        return [i.prompt.tobytes() for i in build_workload(parse_scenario(doc, "s.toml"))]

    small = {"conversations": 3, "turns": 2, "system_prompt": 16}
    assert tokens({"seed": 5, "workload": small}) == tokens({"seed": 9, "workload": {**small, "seed": 5}})
    assert tokens({"seed": 5, "workload": small}) != tokens({"seed": 6, "workload": small})
    items = build_workload(parse_scenario({"seed": 5, "workload": small}, "s.toml"))
    assert all(np.array_equal(i.prompt[:16], items[0].prompt[:16]) for i in items)


def test_a_trace_path_under_an_unknown_users_home_is_taken_literally() -> None:
    """`~name/...` of a user the machine does not have stays as written (as a shell leaves it),
    relative to the scenario file, instead of a RuntimeError from pathlib."""
    scenario = parse_scenario({"workload": {"kind": "trace", "path": "~no-such-user-0/t.jsonl"}}, "/s/x.toml")
    assert scenario.workload.path == "/s/~no-such-user-0/t.jsonl"
