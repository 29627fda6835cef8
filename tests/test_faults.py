"""Fault injection: the spec and its validation, the seeded decisions, and what faults do to both
drivers. Whatever fails, every request ends exactly once; only a prefill transfer that keeps
failing may fail one (with its reason); no slot, lock or pin is left behind; and in the runtime
every request that finishes has bit-exact KV."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from node_pair import PAGE, assert_nothing_held, node_pair, prompt, turn

from hicache.core.config import DecodeConfig
from hicache.faults import APPLIES, OPS, Decision, FaultSpec, FaultSpecError, decide, uniforms
from hicache.runtime.decode.decode_node import DecodeService
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.storage.memory_store import MemoryStore
from hicache.runtime.transfer.tcp import TcpEngine
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire.client import DecodeClient
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import ScenarioError, load_scenario, parse_scenario
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups

PAIRS = [(op, kind) for op in OPS for kind in APPLIES[op]]


def fault(kind: str, rate: float) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "rate": rate}
    if kind == "delay":
        out["seconds"] = [0.001, 0.05]
    return out


# ============================================================================ the spec


def test_a_full_spec_parses_and_round_trips() -> None:
    data = {
        "seed": 3,
        "l3_get": {"kind": "error", "rate": 0.01},
        "transfer": [{"kind": "peer_death", "rate": 0.001}, {"kind": "corrupt", "rate": 0.5}],
        "load": {"kind": "delay", "rate": 0.1, "seconds": [0.001, 0.05]},
        "timer": {"kind": "delay", "rate": 1, "seconds": 2},
    }
    spec = FaultSpec.parse(data)
    assert spec.seed == 3 and spec.active
    assert [f.kind for f in spec.faults("transfer")] == ["peer_death", "corrupt"]
    assert spec.faults("load")[0].seconds == (0.001, 0.05)
    assert spec.faults("timer")[0].seconds == (2.0, 2.0)
    assert spec.faults("backup") == ()
    assert FaultSpec.parse(spec.to_dict()) == spec
    assert FaultSpec.from_arg(spec.to_arg()) == spec
    assert not FaultSpec.parse({"seed": 1, "load": {"kind": "error", "rate": 0}}).active


def test_the_command_line_list_means_the_same_as_the_table() -> None:
    listed = FaultSpec.from_arg("l3_get:error:0.01, load:delay:0.1:0.001..0.05,transfer:error:0.2,seed:7")
    table = FaultSpec.parse(
        {
            "seed": 7,
            "l3_get": {"kind": "error", "rate": 0.01},
            "load": {"kind": "delay", "rate": 0.1, "seconds": [0.001, 0.05]},
            "transfer": {"kind": "error", "rate": 0.2},
        }
    )
    assert listed == table
    both = FaultSpec.from_arg("transfer:error:0.1,transfer:peer_death:0.2")
    assert [f.kind for f in both.faults("transfer")] == ["error", "peer_death"]


@pytest.mark.parametrize(
    ("data", "field", "needle"),
    [
        ([], "faults", "expected a table"),
        ({"seed": -1}, "faults.seed", "integer"),
        ({"seed": True}, "faults.seed", "integer"),
        ({"l3_fetch": {"kind": "error", "rate": 0.1}}, "faults.l3_fetch", "unknown operation kind"),
        ({"load": 0.1}, "faults.load", "expected a table"),
        ({"load": []}, "faults.load", "at least one fault"),
        ({"load": {"rate": 0.1}}, "faults.load.kind", "required"),
        ({"load": {"kind": "melt", "rate": 0.1}}, "faults.load.kind", "unknown fault 'melt'"),
        ({"load": {"kind": "peer_death", "rate": 0.1}}, "faults.load.kind", "does not apply to load"),
        ({"timer": {"kind": "corrupt", "rate": 0.1}}, "faults.timer.kind", "does not apply to timer"),
        ({"load": {"kind": "error"}}, "faults.load.rate", "required"),
        ({"load": {"kind": "error", "rate": 1.5}}, "faults.load.rate", "[0, 1]"),
        ({"load": {"kind": "error", "rate": "1%"}}, "faults.load.rate", "'1%'"),
        ({"load": {"kind": "error", "rate": float("nan")}}, "faults.load.rate", "probability"),
        ({"load": {"kind": "delay", "rate": 0.1}}, "faults.load.seconds", "required for a delay"),
        ({"load": {"kind": "delay", "rate": 0.1, "seconds": [2, 1]}}, "faults.load.seconds", "lo <= hi"),
        ({"load": {"kind": "delay", "rate": 0.1, "seconds": -1}}, "faults.load.seconds", "-1"),
        ({"load": {"kind": "delay", "rate": 0.1, "seconds": [1]}}, "faults.load.seconds", "[1]"),
        ({"load": {"kind": "error", "rate": 0.1, "seconds": 1}}, "faults.load.seconds", "only a delay"),
        ({"load": {"kind": "error", "rate": 0.1, "when": 1}}, "faults.load.when", "unknown key"),
        (
            {"transfer": [{"kind": "error", "rate": 0.1}, {"kind": "delay", "rate": 0.1}]},
            "faults.transfer[1].seconds",
            "required",
        ),
        (
            {"transfer": [{"kind": "error", "rate": 0.6}, {"kind": "partial", "rate": 0.6}]},
            "faults.transfer",
            "add up to 1.2",
        ),
    ],
)
def test_a_bad_spec_names_its_field(data: Any, field: str, needle: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        FaultSpec.parse(data)
    assert info.value.field == field and needle in info.value.detail, str(info.value)
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("{not json", "--faults"),
        ("load:error", "--faults"),
        ("load:error:often", "--faults.load"),
        ("seed:x", "--faults.seed"),
        ("load:peer_death:0.1", "--faults.load.kind"),
    ],
)
def test_a_bad_command_line_spec_names_its_field(text: str, field: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        FaultSpec.from_arg(text)
    assert info.value.field == field


def test_a_scenario_file_takes_a_faults_section_and_names_bad_fields(tmp_path: Path) -> None:
    path = tmp_path / "f.toml"
    path.write_text(
        '[faults]\nseed = 2\nl3_get = { kind = "error", rate = 0.01 }\n'
        'load = { kind = "delay", rate = 0.1, seconds = [0.001, 0.05] }\n'
    )
    scenario = load_scenario(path)
    assert scenario.faults is not None and scenario.faults.seed == 2
    assert scenario.to_dict()["faults"] == scenario.faults.to_dict()
    assert parse_scenario(scenario.to_dict(), str(path)) == scenario
    plain = tmp_path / "plain.toml"
    plain.write_text('name = "plain"\n')
    assert load_scenario(plain).faults is None and "faults" not in load_scenario(plain).to_dict()
    assert (
        load_scenario(path, ['faults.load={kind="error",rate=0.5}']).faults.faults("load")[0].kind == "error"
    )
    with pytest.raises(ScenarioError) as info:
        load_scenario(path, ['faults.timer={kind="partial",rate=0.1}'])
    assert str(info.value).startswith("--set: faults.timer.kind: ")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path, ["faults.disk=1"])
    assert info.value.field == "faults.disk"
    path.write_text('[faults]\nload = { kind = "corrupt", rate = 2 }\n')
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert str(info.value).startswith(f"{path}: faults.load.rate: ")


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(10**300, 10**400)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@pytest.mark.slow
@settings(max_examples=examples(300), deadline=None)
@given(
    st.dictionaries(st.sampled_from([*OPS, "seed", "zz"]), JSON, max_size=3)
    | st.dictionaries(
        st.sampled_from(OPS),
        st.fixed_dictionaries(
            {"kind": st.sampled_from(["error", "delay", "partial", "corrupt", "peer_death"]), "rate": JSON},
            optional={"seconds": JSON},
        ),
        max_size=2,
    )
)
def test_any_data_is_a_spec_or_an_error_naming_a_field(data: dict[str, Any]) -> None:
    try:
        spec = FaultSpec.parse(data)
    except FaultSpecError as exc:
        assert exc.field.startswith("faults") and exc.detail
        return
    assert FaultSpec.parse(spec.to_dict()) == spec


@st.composite
def specs(draw: st.DrawFn, rate: st.SearchStrategy[float] | None = None) -> dict[str, Any]:
    """A valid spec as plain data: some operation kinds, one or two faults each."""
    rates = rate if rate is not None else st.floats(0, 0.5, allow_nan=False)
    out: dict[str, Any] = {"seed": draw(st.integers(0, 2**64 - 1))}
    for op in draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=4, unique=True)):
        kinds = draw(st.lists(st.sampled_from(APPLIES[op]), min_size=1, max_size=2, unique=True))
        faults = [fault(k, draw(rates)) for k in kinds]
        out[op] = faults[0] if len(faults) == 1 else faults
    return out


@settings(max_examples=examples(200), deadline=None)
@given(specs())
def test_valid_specs_round_trip_through_data_and_the_command_line(data: dict[str, Any]) -> None:
    spec = FaultSpec.parse(data)
    assert FaultSpec.parse(json.loads(json.dumps(spec.to_dict()))) == spec
    assert FaultSpec.from_arg(spec.to_arg()) == spec


# ============================================================================ decisions


def test_decisions_are_a_pure_function_of_seed_op_and_id() -> None:
    spec = FaultSpec.parse({"seed": 5, "load": fault("partial", 0.3), "l3_get": fault("error", 0.3)})
    forward = [decide(spec, "load", i) for i in range(500)]
    backward = [decide(spec, "load", i) for i in reversed(range(500))][::-1]
    assert forward == backward  # no hidden stream: order does not matter
    assert forward != [decide(FaultSpec.parse({**spec.to_dict(), "seed": 6}), "load", i) for i in range(500)]
    assert [d is None for d in forward] != [decide(spec, "l3_get", i) is None for i in range(500)]
    assert [decide(spec, "load", i, node=1) for i in range(500)] != forward
    assert decide(spec, "backup", 1) is None


@pytest.mark.parametrize("rate", [0.001, 0.01, 0.1, 0.5])
def test_the_share_of_operations_hit_matches_the_rate(rate: float) -> None:
    spec = FaultSpec.parse({"seed": 11, "transfer": [fault("error", rate), fault("delay", rate)]})
    n = 40_000
    kinds = Counter(d.kind for i in range(n) if (d := decide(spec, "transfer", i)) is not None)
    for kind in ("error", "delay"):
        sigma = (n * rate * (1 - rate)) ** 0.5
        assert abs(kinds[kind] - n * rate) < 5 * sigma + 1, (kind, kinds)
    delays = [d.delay for i in range(2000) if (d := decide(spec, "transfer", i)) and d.kind == "delay"]
    assert all(0.001 <= x <= 0.05 for x in delays)


@settings(max_examples=examples(300), deadline=None)
@given(st.floats(0, 1, exclude_max=True), st.integers(1, 10_000))
def test_a_partial_completes_strictly_less_and_a_corrupt_page_is_in_range(fraction: float, n: int) -> None:
    d = Decision("load", "partial", 0.0, fraction)
    assert 0 <= d.prefix(n) < n and 0 <= d.index(n) < n
    assert d.prefix(0) == 0


def test_uniforms_are_in_the_unit_interval_and_spread() -> None:
    draws = np.array([uniforms(1, "load", i) for i in range(5000)])
    assert draws.min() >= 0 and draws.max() < 1
    assert np.all(np.abs(draws.mean(axis=0) - 0.5) < 0.02)
    assert abs(np.corrcoef(draws[:, 0], draws[:, 2])[0, 1]) < 0.05


# ============================================================================ the simulator

SIM_DOC: dict[str, Any] = {
    "name": "faults",
    "workload": {
        "kind": "multiturn",
        "conversations": 12,
        "turns": 4,
        "system_prompt": 1024,
        "user_tokens": [128, 512],
        "output_tokens": [64, 256],
        "rate": 2.0,
        "think_time": 10.0,
    },
    "model": {"preset": "llama-3-8b"},
    "hardware": {"network_bandwidth": 1e9},
    "cache": {
        "page_size": 64,
        "l1_tokens": 6144,
        "hicache_ratio": 1.0,
        "prefetch_threshold_tokens": 128,
        "decode_reserve_tokens": 256,
        "prefetch_timeout_base": 0.01,
    },
    "run": {"baselines": ["l1_l2_l3"]},
}


def sim_run(faults: dict[str, Any] | None) -> tuple[Any, Cluster]:
    doc = dict(SIM_DOC)
    if faults is not None:
        doc["faults"] = faults
    scenario = parse_scenario(doc, "faults.toml")
    cluster = Cluster(setups(scenario)["l1_l2_l3"])
    return cluster.run(build_workload(scenario)), cluster


def check_sim_run(result: Any, cluster: Cluster, transfer_faults: bool) -> None:
    """Every request answered once; failures only from transfers, with their reason; nothing held."""
    scenario = parse_scenario(SIM_DOC, "faults.toml")
    ids = [r.id for r in result.records]
    assert sorted(ids) == sorted(i.id for i in build_workload(scenario))
    assert len(set(ids)) == len(ids)
    for r in result.records:
        assert r.outcome in ("finished", "failed"), r
        if r.outcome == "failed":
            assert transfer_faults and r.reason.startswith("prefill transfer failed after 3 attempts: "), r
        else:
            assert r.cached + r.transferred_tokens == r.prompt_tokens, r
    for d in cluster.decode:
        audit = d.core.audit()
        assert audit["l1_leaked"] == audit["l2_leaked"] == 0, audit
        assert audit["locks"] == audit["pins"] == audit["live"] == audit["reserved"] == 0, audit


def test_the_simulated_workload_uses_every_tier() -> None:
    result, cluster = sim_run(None)
    check_sim_run(result, cluster, transfer_faults=False)
    s = result.summary
    assert s["failed"] == 0 and s["fallback_tokens"] == 0 and "faults_injected" not in s
    assert all(s["cached_tokens"][t] > 0 for t in ("l1", "l2", "l3")), s["cached_tokens"]


RESTORE_FAULTS = {
    ("l3_get", "error"),
    ("l3_get", "partial"),
    ("l3_get", "corrupt"),
    ("l3_put", "corrupt"),  # the damaged page is still counted by queries, so it is promised
    ("load", "error"),
    ("load", "partial"),
    ("load", "corrupt"),
    ("backup", "corrupt"),  # a silent bad copy: found by the load-back that reads it
    ("timer", "error"),
}
# Copies that report their failed pages (`BackupDone.failed`): those pages are never counted
# on L2, so nothing is promised from them and nothing falls short.
REPORTED_FAULTS = {("backup", "error"), ("backup", "partial")}


@pytest.mark.parametrize(("op", "kind"), PAIRS)
def test_each_fault_at_a_high_rate_degrades_without_failing_or_leaking(op: str, kind: str) -> None:
    result, cluster = sim_run({"seed": 1, op: fault(kind, 0.5)})
    check_sim_run(result, cluster, transfer_faults=op == "transfer")
    s = result.summary
    assert s["faults_injected"].get(f"{op}.{kind}", 0) > 0, s["faults_injected"]
    if op != "transfer" or kind == "delay":
        assert s["failed"] == 0
    if (op, kind) in RESTORE_FAULTS:
        assert s["fallback_tokens"] > 0  # the shortfall was re-requested from prefill, and counted
    if (op, kind) in REPORTED_FAULTS:
        assert cluster.decode[0].core.tree.stats.backup_failed > 0
    if op == "transfer" and kind != "delay":
        assert cluster.decode[0].core.stats.transfer_retries > 0


def test_transfers_that_always_fail_fail_every_request_with_the_reason() -> None:
    result, cluster = sim_run({"transfer": fault("peer_death", 1.0)})
    check_sim_run(result, cluster, transfer_faults=True)
    assert {r.outcome for r in result.records} == {"failed"}
    assert {r.reason for r in result.records} == {
        "prefill transfer failed after 3 attempts: prefill peer died mid-transfer"
    }


@settings(max_examples=examples(15), deadline=None)
@given(specs(rate=st.sampled_from([0.2, 0.5])))
def test_any_mix_of_faults_keeps_every_promise_and_runs_the_same_twice(data: dict[str, Any]) -> None:
    first, cluster = sim_run(data)
    check_sim_run(first, cluster, transfer_faults="transfer" in data)
    again, _ = sim_run(data)
    assert [repr(attrs.astuple(r)) for r in again.records] == [repr(attrs.astuple(r)) for r in first.records]


# ============================================================================ the runtime


@asynccontextmanager
async def runtime(
    tmp_path: Path, faults: dict[str, Any] | None, *, retries: int = 2, storage: bool = True
) -> AsyncIterator[tuple[DecodeService, DecodeClient, KVLedger]]:
    """A prefill node and a decode service in this process, over the TCP engine."""
    async with node_pair(tmp_path, faults, retries=retries, storage=storage) as pair:
        yield pair.service, pair.client, pair.ledger


@pytest.mark.parametrize("kind", [None, "error", "corrupt"])
async def test_l3_read_faults_become_misses_with_fallback_and_exact_kv(
    tmp_path: Path, kind: str | None
) -> None:
    faults = {"l3_get": {"kind": kind, "rate": 1.0}} if kind else None
    async with runtime(tmp_path, faults) as (service, client, ledger):
        first = prompt(1)
        reply = await turn(client, ledger, "a", first)
        await client.evict(l1=1 << 30, l2=1 << 30)  # only the L3 files keep the conversation
        await client.idle()
        nxt = first + reply["tokens"] + prompt(2, 20)
        reply = await turn(client, ledger, "b", nxt)
        assert reply["outcome"] == "finished"
        a = reply["account"]
        held = (len(first) + 2) // PAGE * PAGE  # prompt + output whose KV exists, in full pages
        assert a["l1"] == a["l2"] == 0 and reply["promised_tokens"] == held
        if kind is None:
            assert a["l3"] == held and a["fallback"] == 0
        else:
            assert a["l3"] < held and a["fallback"] == held - a["l3"] > 0
            assert service.audit()["faults_injected"] == {f"l3_get.{kind}": 1}
        if kind == "corrupt":
            assert service.store.stats.corrupt == 1  # the file's CRC turned the flipped byte into a miss
        await assert_nothing_held(service, client)


@pytest.mark.parametrize("kind", [None, "corrupt", "error"])
async def test_a_bad_l2_page_is_caught_after_the_load_back_and_re_requested(
    tmp_path: Path, kind: str | None
) -> None:
    faults = {"backup": {"kind": kind, "rate": 1.0}} if kind else None
    async with runtime(tmp_path, faults, storage=False) as (service, client, ledger):
        first = prompt(3)
        reply = await turn(client, ledger, "a", first)
        await client.evict(l1=1 << 30)  # L1 -> L2 only
        await client.idle()
        second = first + reply["tokens"] + prompt(4, 20)
        reply = await turn(client, ledger, "b", second)
        a = reply["account"]
        held = (len(first) + 2) // PAGE * PAGE
        caught = service.audit().get("faults_caught", {})
        if kind is None:
            assert a["l2"] == held and a["fallback"] == 0
        elif kind == "corrupt":  # bad at rest: caught after the load-back, re-requested from that page on
            assert a["l2"] < held and a["fallback"] == held - a["l2"] > 0
            assert caught["l2_page_rejected"] >= 1
        else:  # the backup reported its pages failed: the core never counted them on L2
            assert a["l2"] == a["fallback"] == 0 and a["transferred"] == len(second)
            assert "l2_page_rejected" not in caught
        await assert_nothing_held(service, client)


def scripted(service: DecodeService, kinds: list[str]) -> list[str]:
    """Give transfer attempts the faults `kinds` in turn, letting the retry after each failing
    one succeed; returns the list the faults are taken from, emptied as they are used."""
    assert service.faults is not None
    queue = list(kinds)
    retry = False

    def take(op: str, op_id: int, sub: int = 0) -> Decision | None:
        nonlocal retry
        if op != "transfer" or retry or not queue:
            retry = False
            return None
        kind = queue.pop(0)
        retry = kind != "delay"
        return Decision("transfer", kind, 0.01, 0.5)

    service.faults.take = take  # type: ignore[method-assign]
    return queue


async def test_transfer_faults_within_the_retries_still_finish_bit_exactly(tmp_path: Path) -> None:
    kinds = ["error", "peer_death", "partial", "corrupt", "delay", "peer_death"]
    async with runtime(tmp_path, {"transfer": fault("error", 1.0)}, retries=3) as (service, client, ledger):
        left = scripted(service, kinds)
        conversation = prompt(5, 40)
        for i in range(len(kinds)):  # one transfer per turn (the rest is on L1), then its retry
            reply = await turn(client, ledger, f"r{i}", conversation)
            assert reply["outcome"] == "finished", reply["reason"]
            conversation = conversation + reply["tokens"] + prompt(10 + i, 24)
        assert left == []  # every scripted fault happened
        assert Counter(service.audit()["faults_injected"]) == Counter(f"transfer.{k}" for k in kinds)
        caught = service.audit()["faults_caught"]
        assert caught["received_page_rejected"] == kinds.count("corrupt")
        assert service.link.generation == 1 + kinds.count("peer_death")  # a new control connection each
        stats = await client.stats()
        assert stats["transfer_retries"] == len(kinds) - kinds.count("delay")
        await assert_nothing_held(service, client)


@pytest.mark.parametrize("kind", ["error", "peer_death"])
async def test_a_transfer_failing_every_time_fails_the_request_with_the_reason(
    tmp_path: Path, kind: str
) -> None:
    async with runtime(tmp_path, {"transfer": fault(kind, 1.0)}) as (service, client, ledger):
        for rid in ("a", "b"):
            reply = await turn(client, ledger, rid, prompt(6))
            assert reply["outcome"] == "failed"
            assert reply["reason"].startswith("prefill transfer failed after 3 attempts: ")
            assert ("injected" in reply["reason"]) and reply["tokens"] == []
        assert service.audit()["faults_injected"] == {f"transfer.{kind}": 6}
        await assert_nothing_held(service, client)


def test_faults_without_page_checks_are_refused(tmp_path: Path) -> None:
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    config = DecodeConfig(l1_pages=8, l2_pages=8, page_size=PAGE)
    spec = FaultSpec.parse({"backup": fault("corrupt", 0.1)})
    with pytest.raises(ValueError, match="PageGuard"):
        DecodeService(
            config, model, layout, FileStore(tmp_path, layout), TcpEngine(), faults=spec, check_pages=False
        )


def test_corrupting_l3_needs_a_store_that_checksums_its_files() -> None:
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    config = DecodeConfig(l1_pages=8, l2_pages=8, page_size=PAGE)
    spec = FaultSpec.parse({"l3_put": fault("corrupt", 0.1)})
    with pytest.raises(FaultSpecError) as info:
        DecodeService(config, model, layout, MemoryStore(layout), TcpEngine(), faults=spec)
    assert info.value.field == "faults.l3_put" and "MemoryStore" in info.value.detail
