"""The digital twin (`hicache sim twin`, sim/twin.py, sim/calibrate.py): a recording's header
becomes the scenario, the cost model is fitted back from a recording the simulator made with
known costs, the twin replays a simulator-made recording exactly (its own consistency), what-ifs
reach the replay, bad input is named, and (marked, short) a real `hicache serve` recording.

A simulator-made recording is written here as `hicache serve --record-trace` writes one: the
header of the node's configuration, then a line per request with its block ids (at the page size,
numbered by the runtime's own `BlockIds`), cached tokens per tier and the measured times.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from hicache.cli import main as cli_main
from hicache.results import RequestRecord
from hicache.runtime.serving.trace_recorder import BlockIds
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import Scenario, ScenarioError, parse_scenario
from hicache.sim import calibrate as twin_calibrate
from hicache.sim import twin
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups

PAGE = 16
LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 4, 2, 16, 2
KV = 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE


def sim_scenario(
    *,
    tps: float = 2000.0,
    attention: float = 0.0,
    step: float = 0.02,
    per_ctx: float = 2e-6,
    latency: float = 0.003,
    transfer: float = 0.0,
    layerwise: bool = True,
    prefill_cache_bytes: int = 512 << 20,
    l1_tokens: int = 40 * PAGE,
    ratio: float = 1.0,
    storage: bool = True,
    closed: bool = True,
    conversations: int = 4,
    turns: int = 4,
) -> Scenario:
    """A small multi-turn chat on a node whose costs are the twin's own parametrisation: the
    prefill rate and attention term, decode step and its per-context cost, first-token latency,
    seconds per token sent P->D (`transfer`; 0: a free link; `layerwise`: streamed while prefill
    computes, else after it), the prefill cache's bytes."""
    lhd = 4.0 * LAYERS * KV_HEADS * HEAD_DIM
    flops = lhd / attention if attention > 0 else 2.0 * 1e15 * tps
    params = flops / (2.0 * tps)
    workload: dict[str, Any] = {
        "kind": "multiturn",
        "conversations": conversations,
        "turns": turns,
        "system_prompt": 48,
        "user_tokens": [8, 120],
        "output_tokens": [4, 40],
        "rate": 0.02,
        "think_time": 60.0,
        "vocab": 500,
    }
    if closed:
        workload["arrivals"] = "closed"
    doc = {
        "name": "synthetic",
        "workload": workload,
        "model": {
            "preset": "",
            "name": "tiny",
            "layers": LAYERS,
            "q_heads": KV_HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "params": params,
            "total_params": 1.0,
            "dtype_bytes": DTYPE,
        },
        "hardware": {
            "gpu": "h100",
            "gpus_per_node": 1,
            "efficiency": 1.0,
            "flops": flops,
            "hbm_bandwidth": KV / (0.8 * per_ctx) if per_ctx > 0 else 1e15,
            "mem_fraction": prefill_cache_bytes / 80e9,
            "host_bandwidth": 1e9,
            "network_bandwidth": KV / transfer if transfer > 0 else 1e15,
            "network_latency": latency,
        },
        "storage": {"bandwidth": 1e9, "latency": 0.002},
        "cluster": {
            "max_running": 1 << 20,
            "decode_step_overhead": step,
            "hicache_step_overhead": 0.0,
            "tick_interval": 1e-4,
            "layerwise_transfer": layerwise,
        },
        "cache": {
            "page_size": PAGE,
            "l1_tokens": l1_tokens,
            "hicache_ratio": ratio,
            "decode_reserve_tokens": PAGE,
        },
        "run": {"baselines": ["l1_l2_l3" if storage else "l1_l2"]},
    }
    return parse_scenario(doc, "synthetic.toml")


def _value(v: Any) -> Any:
    return getattr(v, "value", v)


def write_recording(path: Path, sc: Scenario) -> list[RequestRecord]:
    """Simulate `sc` and write what it served as `hicache serve --record-trace` would."""
    (setup,) = setups(sc).values()
    items = build_workload(sc)
    records = Cluster(setup).run(items, clients=sc.workload.clients).records
    by_id = {item.id: item for item in items}
    decode = {k: _value(v) for k, v in attrs.asdict(setup.decode, recurse=False).items()}
    header = {
        "hicache_trace_header": 1,
        "format": "mooncake",
        "block_size": PAGE,
        "order": "completion",
        "started_at": "2026-01-01T00:00:00+00:00",
        "model": "tiny",
        "geometry": {
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "page_bytes": KV * PAGE,
        },
        "page_size": PAGE,
        "l1_pages": setup.decode.l1_pages,
        "l2_pages": setup.decode.l2_pages,
        "decode_config": decode,
        "storage": {"kind": "MemoryStore", "capacity_bytes": None, "capacity_pages": None},
        "nodes": {"decode": 1, "prefill": 1, "router": None},
        "measured": {
            "link_bytes_per_s": None,
            "storage_read_bytes_per_s": None,
            "storage_write_bytes_per_s": None,
        },
        "decode_nodes": [],
        "prefill_cache_bytes": (setup.prefill_cache_pages or (0,))[0] * PAGE * KV,
    }
    blocks = BlockIds("tiny", PAGE)
    sessions: dict[str, int] = {}
    lines = [json.dumps(header)]
    for r in sorted(records, key=lambda r: r.arrival + r.e2e_s):  # completion order
        item = by_id[r.id]
        assert item.prompt is not None
        line = {
            "timestamp": round(r.arrival * 1000.0, 3),
            "input_length": r.prompt_tokens,
            "output_length": r.output_tokens,
            "hash_ids": blocks.ids(item.prompt.tolist(), None),
            "session_id": sessions.setdefault(r.session, len(sessions)),
            "cached_tokens": {"l1": r.cached_l1, "l2": r.cached_l2, "l3": r.cached_l3},
            "prefill_cached_tokens": r.prefill_cached_tokens,
            "transferred_tokens": r.transferred_tokens,
            "ttft_s": None if math.isnan(r.ttft_s) else round(r.ttft_s, 6),
            "tpot_s": None if math.isnan(r.tpot_s) else round(r.tpot_s, 6),
            "finish_reason": "length" if r.outcome == "finished" else None,
        }
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n")
    return records


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("twin") / "sim.jsonl"
    write_recording(path, sim_scenario())
    return path


# ============================================================================ header -> scenario


def test_the_header_becomes_the_scenario(recorded: Path) -> None:
    rec = twin.read_recording(recorded)
    header = rec.header
    facts = twin.node_facts(rec)
    sc = twin.scenario(rec, facts, twin.header_costs(facts))
    assert sc.workload.kind == "trace" and sc.workload.path == str(recorded.absolute())
    assert sc.workload.arrivals == "closed"  # the recording names sessions
    assert (sc.model.layers, sc.model.kv_heads, sc.model.head_dim, sc.model.dtype_bytes) == (
        LAYERS,
        KV_HEADS,
        HEAD_DIM,
        DTYPE,
    )
    assert sc.model.preset == ""
    assert sc.cache.page_size == header["page_size"]
    assert sc.cache.l1_tokens == header["l1_pages"] * PAGE
    assert sc.cache.l2_pages_for(sc.cache.l1_tokens // PAGE) == header["l2_pages"]
    for key in twin.CACHE_POLICY_KEYS:  # every policy as the node ran it
        assert getattr(sc.cache, key) == header["decode_config"][key], key
    assert sc.cluster.decode_nodes == 1 and sc.cluster.prefill_nodes == 1
    assert sc.storage.capacity_tokens == 0 and sc.run.baselines == ("l1_l2_l3",)
    (setup,) = setups(sc).values()
    assert setup.decode.l1_pages == header["l1_pages"] and setup.decode.l2_pages == header["l2_pages"]


def _rewrite_header(src: Path, dst: Path, change: dict[str, Any], drop: tuple[str, ...] = ()) -> Path:
    lines = src.read_text().splitlines()
    header = json.loads(lines[0])
    for key, value in change.items():
        section, _, sub = key.partition(".")
        if sub:
            header[section][sub] = value
        else:
            header[section] = value
    for key in drop:
        section, _, sub = key.partition(".")
        if sub:
            del header[section][sub]
        else:
            del header[section]
    dst.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    return dst


@pytest.mark.parametrize(
    ("change", "drop", "field"),
    [
        ({"colour": "blue"}, (), "'colour': unknown"),
        ({"geometry.rope": 1}, (), "'geometry.rope': unknown"),
        ({"decode_config.turbo": True}, (), "'decode_config.turbo': unknown"),
        ({"nodes.spare": 1}, (), "'nodes.spare': unknown"),
        ({}, ("geometry.layers",), "'geometry.layers' must be an integer"),
        ({}, ("page_size",), "'page_size' must be an integer"),
        ({}, ("decode_config",), "'decode_config' missing"),
        ({"geometry.dtype": "int4"}, (), "'geometry.dtype'"),
        ({"prefill_cache_bytes": -1}, (), "'prefill_cache_bytes' must be an integer >= 0"),
        ({"prefill_cache_bytes": "big"}, (), "'prefill_cache_bytes' must be an integer >= 0"),
        ({"front_door": {"max_running": 4, "queue": 2}}, (), "'front_door.queue': unknown"),
        ({"front_door": {"max_running": 0}}, (), "'front_door.max_running' must be an integer"),
        ({"front_door": [4]}, (), "'front_door' must be an object"),
    ],
)
def test_an_unknown_or_missing_header_field_is_named(
    recorded: Path, tmp_path: Path, change: dict[str, Any], drop: tuple[str, ...], field: str
) -> None:
    path = _rewrite_header(recorded, tmp_path / "t.jsonl", change, drop)
    with pytest.raises(twin.TwinError, match=rf"t\.jsonl:1: field {field}"):
        twin.node_facts(twin.read_recording(path))


def test_the_front_door_the_header_records_is_replayed(recorded: Path, tmp_path: Path) -> None:
    """A recording made behind `hicache serve`'s front door replays behind one: its requests at
    once from the header, its tokens the decode node's L1 (so a what-if's smaller L1 narrows the
    door too); without it in the header there is none."""
    rec = twin.read_recording(recorded)
    assert twin.node_facts(rec).front_door_running == 0
    cal = twin.header_costs(twin.node_facts(rec))
    assert twin.scenario(rec, twin.node_facts(rec), cal).cluster.front_door_running == 0
    door = {"max_running": 2, "max_tokens": 1 << 20, "reserve_tokens": 16}
    rec = twin.read_recording(_rewrite_header(recorded, tmp_path / "door.jsonl", {"front_door": door}))
    facts = twin.node_facts(rec)
    sc = twin.scenario(rec, facts, cal)
    assert facts.front_door_running == 2 and sc.cluster.front_door_running == 2
    (setup,) = setups(sc).values()
    assert setup.door_max_running == 2 and setup.door_max_tokens == facts.l1_pages * PAGE
    (small,) = setups(twin.scenario(rec, facts, cal, [f"cache.l1_tokens={8 * PAGE}"])).values()
    assert small.door_max_tokens == 8 * PAGE
    res = twin.twin(rec.path)
    assert res.predicted["requests"] == len(rec.requests)


# ============================================================================ calibration


@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    tps=st.floats(300.0, 5000.0),
    with_attention=st.booleans(),
    step=st.floats(0.005, 0.05),
    per_ctx=st.sampled_from([0.0, 1e-6, 1e-5]),
    latency=st.floats(0.001, 0.02),
)
def test_calibration_recovers_the_costs_of_a_simulator_made_recording(
    tmp_path_factory: pytest.TempPathFactory,
    tps: float,
    with_attention: bool,
    step: float,
    per_ctx: float,
    latency: float,
) -> None:
    """Requests one at a time (the think time dwarfs a request), so every measured time is the
    cost model's own formula plus at most a tick: the fit must give the costs back."""
    attention = 1.0 / (tps * 300.0) if with_attention else 0.0
    sc = sim_scenario(
        tps=tps, attention=attention, step=step, per_ctx=per_ctx, latency=latency, l1_tokens=4096 * PAGE
    )
    path = tmp_path_factory.mktemp("cal") / "t.jsonl"
    write_recording(path, sc)
    cal = twin.fit(twin.samples(twin.read_recording(path)))
    assert cal.prefill_tokens_per_s == pytest.approx(tps, rel=0.05)
    assert cal.decode_step_s == pytest.approx(step + 1.0 / tps, rel=0.05, abs=5e-4)
    assert cal.decode_step_per_context_token_s == pytest.approx(per_ctx, rel=0.1, abs=2e-7)
    assert cal.prefill_attention_s == pytest.approx(attention, rel=0.15, abs=0.1 / (tps * 300.0))
    assert cal.first_token_overhead_s == pytest.approx(latency, abs=2e-3)
    assert cal.ttft_residual_rms_s < 2e-3 and cal.tpot_residual_rms_s < 2e-3


def _mean_ttft(records: list[RequestRecord]) -> float:
    return sum(r.ttft_s for r in records) / len(records)


def test_the_transfer_cost_is_fitted_and_the_l2_what_if_predicts_the_transfers_it_saves(
    tmp_path: Path,
) -> None:
    """A node whose P->D link costs 0.1 ms a token (a fifth of prefill's 0.5 ms), sent after
    prefill: a turn whose history the decode node lost sends it again, and the prefill cache
    (holding every prompt) computes only the new tokens, so the two columns part and the fit
    gives every cost back. Then L2 doubled: the twin's predicted TTFT change is the one the
    same known-cost node has with L2 doubled, which is the transfers it saves (times 0.1 ms)."""
    transfer = 1e-4
    kw: dict[str, Any] = {"transfer": transfer, "layerwise": False, "l1_tokens": 30 * PAGE, "storage": False}
    base, doubled = tmp_path / "base.jsonl", tmp_path / "l2x2.jsonl"
    truth = {"base": write_recording(base, sim_scenario(ratio=1.0, **kw))}
    truth["l2x2"] = write_recording(doubled, sim_scenario(ratio=2.0, **kw))
    assert all(r.outcome == "finished" for rs in truth.values() for r in rs)
    samples = twin.samples(twin.read_recording(base))
    assert sum(s.transferred != s.computed for s in samples) >= twin_calibrate.MIN_ROWS_PER_TERM
    cal = twin.fit(samples)
    assert cal.transfer_seconds_per_token == pytest.approx(transfer, rel=0.01)
    assert cal.prefill_tokens_per_s == pytest.approx(2000.0, rel=0.01)
    assert cal.first_token_overhead_s == pytest.approx(0.003, abs=2e-4)
    assert cal.ttft_residual_rms_s < 1e-4
    res = twin.twin(base, ["cache.hicache_ratio=2.0"])
    assert res.what_if is not None and res.what_if["hit_rate"] > res.predicted["hit_rate"] + 0.1
    # What the known costs imply: the tokens no longer sent, at 0.1 ms each (L2 restores at 1 GB/s
    # cost 0.5 us a token, well under the tolerance), over the requests.
    by_id = {r.id: r for r in truth["base"]}
    saved = sum(by_id[r.id].transferred_tokens - r.transferred_tokens for r in truth["l2x2"])
    implied = -saved * transfer / len(truth["base"])
    real = _mean_ttft(truth["l2x2"]) - _mean_ttft(truth["base"])
    assert real == pytest.approx(implied, abs=2e-4) and real < -0.05 * _mean_ttft(truth["base"])
    predicted = res.what_if["ttft_mean_s"] - res.predicted["ttft_mean_s"]
    assert predicted == pytest.approx(real, abs=2e-4)
    # Without the transfer term (a recording that does not part the columns) no saving is seen.
    folded = twin.fit([attrs.evolve(s, transferred=s.computed) for s in samples])
    assert folded.transfer_seconds_per_token is None


def test_the_prefill_cache_is_the_size_the_header_records(tmp_path: Path) -> None:
    """A prefill node whose cache holds 40 pages' KV computes turns again that a 512 MiB one
    would not: with the header's size the twin predicts TTFT as recorded; a header without the
    field (older recordings) is read as the runtime's default, 512 MiB, which predicts too
    little compute; 0 bytes is no prefill cache."""
    small = 40 * PAGE * KV
    path = tmp_path / "small.jsonl"
    write_recording(path, sim_scenario(prefill_cache_bytes=small + KV, conversations=6))  # + weights
    rec = twin.read_recording(path)
    facts = twin.node_facts(rec)
    assert facts.prefill_cache_bytes == small
    (setup,) = setups(twin.scenario(rec, facts, twin.header_costs(facts))).values()
    assert setup.prefill_cache_pages is not None and setup.prefill_cache_pages[0] == 40
    assert sum(r.prefill_cached or 0 for r in rec.requests) < sum(r.input_length for r in rec.requests)
    # On the node's own costs (the header's), so that only the prefill cache's size differs.
    assert abs(twin.twin(path, calibrate=False).errors["ttft_mean"] or 0.0) < 1e-3
    old = _rewrite_header(path, tmp_path / "old.jsonl", {}, drop=("prefill_cache_bytes",))
    assert twin.node_facts(twin.read_recording(old)).prefill_cache_bytes == twin.PREFILL_CACHE_BYTES
    assert (twin.twin(old, calibrate=False).errors["ttft_mean"] or 0.0) < -0.1
    none = _rewrite_header(path, tmp_path / "none.jsonl", {"prefill_cache_bytes": 0})
    rec = twin.read_recording(none)
    assert not twin.scenario(rec, twin.node_facts(rec), twin.header_costs(facts)).cluster.prefill_cache


@pytest.mark.parametrize("seed", range(4))
def test_the_fit_is_the_least_squares_with_nonnegative_coefficients(seed: int) -> None:
    """The columns of study 4's recording (6 chats x 6 turns, a prefill cache holding every prompt:
    attention pairs and transferred tokens grow together over turns, transferred and L2 tokens
    trade within one) and noisy TTFTs: the coefficients meet the optimality conditions of
    least squares under >= 0 (gradient 0 where > 0, and <= 0 where 0), so no column the data
    needs is dropped. (Seed 0 is one where dropping the most negative coefficient and solving
    again left the transfer term out.)"""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for t in range(6):
        prompt, computed = 31 + 36 * t, [15, 51, 37, 41, 45, 49][t]
        for _ in range(6):
            l2 = int(rng.choice([0, 16, 64])) if t >= 2 else 0
            x = max(1, prompt - 16 - l2 - (16 if t < 3 else 0))
            pairs = computed * (prompt - computed) + computed * (computed - 1) / 2
            rows.append([1.0, computed, pairs, x, l2])
    a = np.array(rows)
    y = a @ np.array([0.05, 0.0026, 4e-6, 1.4e-4, 0.0]) + rng.normal(0.0, 0.01, len(rows))
    coef = twin_calibrate.nnls(a, y)
    grad = a.T @ (y - a @ coef) / np.linalg.norm(a, axis=0)
    assert (coef >= 0).all()
    assert np.all(np.abs(grad[coef > 0]) < 1e-9) and np.all(grad[coef == 0] <= 1e-9)


def _linear_samples(rng: Any, n: int, per_token: float, overhead: float) -> list[twin.Sample]:
    """Requests of varied prompts whose TTFT is `overhead + per_token * computed` plus a little
    noise, and whose TPOT grows with the context."""
    out = []
    for _ in range(n):
        prompt = int(rng.integers(50, 2000))
        computed = int(rng.integers(1, prompt + 1))
        ttft = overhead + per_token * computed + float(rng.normal(0.0, 0.002))
        tpot = 0.02 + 1e-6 * prompt + float(rng.normal(0.0, 1e-4))
        out.append(
            twin.Sample(prompt=prompt, output=20, computed=computed, l2=0, l3=0, ttft_s=ttft, tpot_s=tpot)
        )
    return out


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), outliers=st.integers(1, 3), stall=st.floats(20.0, 200.0))
def test_an_outlier_request_does_not_move_the_fit(seed: int, outliers: int, stall: float) -> None:
    """A few requests that stalled for tens of seconds (a reason the cost model does not know)
    among 40 ordinary ones: the robust fit gives the ordinary requests' costs back and says how
    many it left out, where plain least squares is pulled far off by them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    per_token, overhead = 1e-3, 0.05
    rows = _linear_samples(rng, 40, per_token, overhead)
    for i in rng.choice(len(rows), outliers, replace=False):
        rows[int(i)] = attrs.evolve(rows[int(i)], ttft_s=(rows[int(i)].ttft_s or 0.0) + stall)
    cal = twin.fit(rows)
    assert cal.prefill_tokens_per_s == pytest.approx(1.0 / per_token, rel=0.05)
    assert cal.first_token_overhead_s == pytest.approx(overhead, abs=0.01)
    assert cal.ttft_trimmed >= outliers
    a = np.column_stack([np.ones(len(rows)), [r.computed for r in rows]])
    plain = twin_calibrate.nnls(a, np.array([r.ttft_s for r in rows]))
    assert (
        abs(plain[0] - overhead) > 0.1 or abs(1.0 / max(plain[1], 1e-12) - 1.0 / per_token) > 0.05 / per_token
    )


@settings(max_examples=10, deadline=None)
@given(coef=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_the_robust_fit_of_exact_data_is_the_exact_fit(coef: list[float], seed: int) -> None:
    """Data a nonnegative model explains exactly: trimming leaves every row in."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = np.column_stack([np.ones(30), rng.uniform(1, 100, 30), rng.uniform(0, 50, 30)])
    y = a @ np.array(coef)
    got, kept = twin_calibrate.robust_nnls(a, y)
    assert np.allclose(a @ got, y, atol=1e-9 * (1 + np.abs(y).max()))
    assert kept.all()


def test_a_term_the_recording_cannot_identify_comes_from_the_prior_with_a_warning() -> None:
    """Every prompt computed the same number of tokens: TTFT cannot grow with them, so prefill's
    rate is the prior's (the node's own settings), named in `fallbacks`; without a prior it is
    an error, as before."""
    flat = [
        twin.Sample(
            prompt=300 + 10 * i, output=10, computed=64, l2=0, l3=0, ttft_s=0.5 + 0.01 * (i % 3), tpot_s=0.02
        )
        for i in range(12)
    ]
    with pytest.raises(ValueError, match="does not grow"):
        twin.fit(flat)
    prior = twin_calibrate.Calibration(
        prefill_tokens_per_s=2000.0,
        prefill_attention_s=0.0,
        first_token_overhead_s=0.0,
        decode_step_s=0.02,
        decode_step_per_context_token_s=0.0,
        source="header",
    )
    cal = twin.fit(flat, prior=prior)
    assert cal.prefill_tokens_per_s == 2000.0
    assert cal.fallbacks == ("prefill_tokens_per_s", "prefill_attention_s")
    # What prefill's prior rate leaves unexplained becomes the first-token overhead.
    assert cal.first_token_overhead_s == pytest.approx(0.51 - 64 / 2000.0, abs=0.01)


def _phased_samples(
    rng: Any,
    n: int,
    k: float,
    att: float,
    sx: float,
    c: float,
    load: float,
    *,
    transfer_is_compute: bool = False,
) -> list[twin.Sample]:
    """Requests whose TTFT is their waits + `c` + prefill's compute + the transfer, with the waits
    growing with the work (a loaded node: a long prompt waits behind long ones), each phase
    recorded; prefill's forwards and the transfer carry fixed costs of their own."""
    out = []
    for _ in range(n):
        prompt = int(rng.integers(40, 600))
        computed = int(rng.integers(1, prompt + 1))
        x = computed if transfer_is_compute else int(rng.integers(0, prompt + 1))
        pairs = computed * (prompt - computed) + computed * (computed - 1) / 2
        compute = 0.004 + k * computed + att * pairs
        transfer = 0.002 + sx * x
        queued = load * compute * float(rng.uniform(0.5, 1.5))
        out.append(
            twin.Sample(
                prompt=prompt,
                output=8,
                computed=computed,
                l2=0,
                l3=0,
                ttft_s=queued + c + compute + transfer,
                tpot_s=0.02 + 1e-6 * prompt,
                transferred=x,
                queued_s=queued,
                compute_s=compute,
                transfer_s=transfer,
            )
        )
    return out


def _unphased(rows: list[twin.Sample]) -> list[twin.Sample]:
    return [attrs.evolve(r, queued_s=None, compute_s=None, transfer_s=None) for r in rows]


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.floats(1e-4, 1e-2),
    att=st.sampled_from([0.0, 1e-7, 1e-6]),
    sx=st.floats(1e-6, 1e-3),
    c=st.floats(0.0, 0.2),
    load=st.floats(0.5, 3.0),
)
def test_recorded_phases_take_the_waits_off_ttft_and_fit_each_rate_to_its_own_time(
    seed: int, k: float, att: float, sx: float, c: float, load: float
) -> None:
    """With the node's phases, the fit recovers prefill's rate and attention cost, the transfer's
    rate and the first token's overhead (c plus the forwards' and the transfer's fixed costs)
    however long the requests queued; from TTFT alone the same requests give a prefill rate
    inflated by the queueing that grows with the work (which the replay then queues again)."""
    import numpy as np

    rows = _phased_samples(np.random.default_rng(seed), 40, k, att, sx, c, load)
    cal = twin.fit(rows)
    assert cal.phased_rows == 40 and cal.fallbacks == ()
    assert cal.queued_mean_s == pytest.approx(float(np.mean([r.queued_s for r in rows])), rel=1e-9)
    assert 1.0 / cal.prefill_tokens_per_s == pytest.approx(k, rel=1e-5)
    assert cal.prefill_attention_s == pytest.approx(att, rel=1e-5, abs=1e-12)
    assert cal.transfer_seconds_per_token == pytest.approx(sx, rel=1e-5)
    assert cal.first_token_overhead_s == pytest.approx(c + 0.004 + 0.002, rel=1e-5, abs=1e-9)
    plain = twin.fit(_unphased(rows))
    assert plain.phased_rows == 0
    assert 1.0 / plain.prefill_tokens_per_s > 1.2 * k or plain.prefill_attention_s > 1.2 * att + 1e-9


def test_a_transfer_that_grows_with_the_computed_tokens_is_told_apart_by_its_own_time() -> None:
    """Every request transferred exactly the tokens prefill computed: from TTFT the two terms are
    one column, and the transfer's is left out (its time lands in prefill's rate); the recorded
    transfer time parts them."""
    import numpy as np

    rows = _phased_samples(np.random.default_rng(7), 30, 2e-3, 0.0, 3e-4, 0.05, 1.0, transfer_is_compute=True)
    assert all(r.transferred == r.computed for r in rows)
    assert twin.fit(_unphased(rows)).transfer_seconds_per_token is None
    cal = twin.fit(rows)
    assert cal.transfer_seconds_per_token == pytest.approx(3e-4, rel=1e-5)
    assert 1.0 / cal.prefill_tokens_per_s == pytest.approx(2e-3, rel=1e-5)


def test_phases_with_an_outlier_and_too_few_rows_still_calibrate() -> None:
    """A request whose forwards stalled is trimmed from prefill's fit; a recording where only two
    requests carry phases fits prefill from TTFT less their waits instead, never failing."""
    import numpy as np

    rows = _phased_samples(np.random.default_rng(3), 30, 1e-3, 0.0, 1e-4, 0.05, 1.0)
    stalled = attrs.evolve(
        rows[4], compute_s=(rows[4].compute_s or 0) + 60.0, ttft_s=(rows[4].ttft_s or 0) + 60.0
    )
    cal = twin.fit([*rows[:4], stalled, *rows[5:]])
    assert 1.0 / cal.prefill_tokens_per_s == pytest.approx(1e-3, rel=1e-5) and cal.ttft_trimmed >= 1
    few = [*rows[:2], *_unphased(rows[2:])]
    cal = twin.fit(few)
    assert cal.phased_rows == 2 and cal.prefill_tokens_per_s > 0 and not cal.fallbacks


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    a=st.floats(0.005, 0.1),
    b=st.floats(0.0, 1e-4),
    k=st.floats(1e-4, 5e-3),
)
def test_a_decode_batch_s_other_requests_come_off_tpot(seed: int, a: float, b: float, k: float) -> None:
    """Requests that decoded beside others measured a TPOT holding the batch's cost, which the
    replay charges again for its own batches: with the batches recorded, the fit gives back the
    step of one request (a, with prefill's per-token cost k for each other request and b per
    token of the batch's contexts)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(30):
        prompt, computed = int(rng.integers(50, 500)), int(rng.integers(10, 50))
        n, context = float(rng.uniform(1.0, 4.0)), float(rng.uniform(100.0, 2000.0))
        tpot = a + (n - 1.0) * k + b * context  # its own step, the others' compute, the batch's contexts
        rows.append(
            twin.Sample(prompt, 10, computed, 0, 0, 0.01 + k * computed, tpot, batch=n, batch_context=context)
        )
    cal = twin.fit(rows)
    assert 1.0 / cal.prefill_tokens_per_s == pytest.approx(k, rel=1e-6)
    assert cal.decode_step_s == pytest.approx(a, rel=1e-6, abs=1e-12)
    assert cal.decode_step_per_context_token_s == pytest.approx(b, rel=1e-5, abs=1e-12)


def _decoding(rid: str, start: float, end: float, prompt: int) -> twin.Recorded:
    """A request whose decode runs from `start` to `end` (its first token at its arrival)."""
    return twin.Recorded(
        id=rid, line=0, arrival=start, input_length=prompt, output_length=4, block_ids=(), session="",
        cached=(0, 0, 0), prefill_cached=None, transferred=None, ttft_s=0.0, tpot_s=None,
        finish_reason="length", finished=end,
    )  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 500), min_size=1, max_size=8),
    length=st.floats(0.1, 3.0),
    gap=st.floats(0.0, 1.0),
)
def test_decode_overlap_counts_the_requests_decoding_at_once(
    prompts: list[int], length: float, gap: float
) -> None:
    """Decodes that never overlap are each alone with their own context (prompt + half the
    output); k decodes of one span share it, each seeing k requests and their k contexts."""
    from hicache.sim import twin_scenario

    apart = [
        _decoding(f"r{i}", i * (length + gap), i * (length + gap) + length, p) for i, p in enumerate(prompts)
    ]
    got = twin_scenario.decode_overlap(twin.Recording(Path("apart.jsonl"), {}, PAGE, tuple(apart)))
    for r in apart:
        assert got[r.id] == pytest.approx((1.0, r.input_length + 2.0), rel=1e-9)
    together = [_decoding(f"r{i}", 1.0, 1.0 + length, p) for i, p in enumerate(prompts)]
    got = twin_scenario.decode_overlap(twin.Recording(Path("together.jsonl"), {}, PAGE, tuple(together)))
    total = sum(p + 2.0 for p in prompts)
    for r in together:
        assert got[r.id] == pytest.approx((len(prompts), total), rel=1e-9)


def test_too_few_measured_requests_cannot_be_calibrated() -> None:
    one = twin.Sample(prompt=100, output=5, computed=100, l2=0, l3=0, ttft_s=0.1, tpot_s=0.01)
    with pytest.raises(ValueError, match="at least 2 requests"):
        twin.fit([one])


# ============================================================================ the twin's consistency


@pytest.mark.parametrize("storage", [True, False])
def test_the_twin_replays_a_simulator_made_recording_exactly(tmp_path: Path, storage: bool) -> None:
    """L1 small enough that turns restore from L2: every request's tiers as recorded."""
    path = tmp_path / "t.jsonl"
    records = write_recording(path, sim_scenario(l1_tokens=30 * PAGE, ratio=2.0, storage=storage))
    assert sum(r.cached_l2 for r in records) > 0  # L2 is exercised
    res = twin.twin(path)
    assert res.tiers_equal == len(records)
    assert res.predicted["cached_tokens"] == res.measured["cached_tokens"]
    assert res.errors["hit_rate_pp"] == pytest.approx(0.0)
    assert abs(res.errors["ttft_mean"] or 0.0) < 0.05


def test_turns_that_overlapped_replay_closed_loop_and_one_client_one_at_a_time(tmp_path: Path) -> None:
    """A recording whose requests never overlapped (one client sending one request at a time)
    replays one request at a time; one where they overlapped replays as a closed loop of its
    sessions, each turn after the previous one's answer and the client's own pause."""
    apart, busy = tmp_path / "apart.jsonl", tmp_path / "busy.jsonl"
    write_recording(apart, sim_scenario())
    doc = sim_scenario().to_dict()
    doc["workload"].update(rate=50.0, think_time=0.01)
    write_recording(busy, parse_scenario(doc, "busy.toml"))
    assert twin.read_recording(apart).one_at_a_time and twin.twin(apart).sequential
    rec = twin.read_recording(busy)
    assert not rec.one_at_a_time
    res = twin.twin(busy, calibrate=False)  # queueing, not compute, sets these TTFTs
    assert not res.sequential and res.predicted["requests"] == len(rec.requests)
    items, _ = twin.work_items(rec, PAGE, "tiny")
    by_session: dict[str, list[Any]] = {}
    for item in items:
        by_session.setdefault(item.session, []).append(item)
    for turns in by_session.values():  # the first turn arrives at its time, the others follow
        assert turns[0].think is None and all(t.think is not None and t.think >= 0 for t in turns[1:])


# ============================================================================ what-ifs


def test_a_what_if_replays_with_the_overrides(recorded: Path) -> None:
    rec = twin.read_recording(recorded)
    facts = twin.node_facts(rec)
    cal = twin.header_costs(facts)
    doubled = twin.scenario(rec, facts, cal, ["cache.hicache_ratio=2"])
    assert doubled.cache.l2_pages_for(doubled.cache.l1_tokens // PAGE) == 2 * facts.l2_pages
    res = twin.twin(recorded, ["run.baselines=['l1_l2']", "cluster.decode_nodes=2"])
    assert res.what_if is not None and res.what_if_baseline == "l1_l2" and res.baseline == "l1_l2_l3"
    assert res.what_if["cached_tokens"]["l3"] == 0
    assert res.what_if_records is not None and {r.decode_node for r in res.what_if_records.values()} == {0, 1}
    with pytest.raises(ScenarioError, match="cache.colour"):
        twin.twin(recorded, ["cache.colour=1"])


def test_a_what_if_s_change_carries_its_interval_over_sessions(recorded: Path) -> None:
    """The interval holds the change over the whole recording's sessions (the statistic the
    bootstrap draws are centred on), the report and summary.json carry it, and the draws are
    the same on every run."""
    small = ["run.baselines=['l1']", f"cache.l1_tokens={32 * PAGE}"]  # L2 and L3 off, L1 smaller
    res = twin.twin(recorded, small)
    assert res.what_if is not None and res.what_if_intervals is not None
    assert res.what_if_sessions == len({r.session for r in twin.read_recording(recorded).requests})
    point = 100.0 * (res.what_if["hit_rate"] - res.predicted["hit_rate"])
    low, high = res.what_if_intervals["hit_rate"] or (math.nan, math.nan)
    assert low <= point + 1e-9 and point - 1e-9 <= high and low < 0  # hits lost
    assert twin.twin(recorded, small).what_if_intervals == res.what_if_intervals
    assert "90% interval" in twin.report(res) and "bootstrap draws" in twin.report(res)
    doc = twin.summary_doc(res)
    assert doc["what_if"]["change_interval"]["hit_rate"] == [low, high]


@settings(max_examples=10, deadline=None)
@given(
    factor=st.floats(0.25, 4.0),
    hits=st.lists(st.integers(0, 100), min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_an_interval_is_exact_where_every_draw_agrees(
    recorded: Path, factor: float, hits: list[int], seed: int
) -> None:
    """A what-if that scales every request's times by one factor changes every draw's mean and p90
    by that factor exactly; one that keeps the tiers changes no draw's hit rate: the interval
    is then a point. Sessions whose hits differ spread the hit-rate interval around the point."""
    from hicache.sim import twin_intervals

    rec = twin.read_recording(recorded)
    base = twin.twin(recorded).records
    scaled = {k: attrs.evolve(r, ttft_s=r.ttft_s * factor, tpot_s=r.tpot_s * factor) for k, r in base.items()}
    iv = twin_intervals.change_intervals(rec, base, scaled, draws=50, seed=seed)
    for key in ("ttft_mean_s", "ttft_p90_s", "tpot_mean_s"):
        assert iv[key] is not None and iv[key] == pytest.approx(
            (factor - 1.0, factor - 1.0), rel=1e-9, abs=1e-12
        )
    assert iv["hit_rate"] == pytest.approx((0.0, 0.0), abs=1e-12)
    sessions = sorted({r.session for r in rec.requests})
    lost = {s: hits[i % len(hits)] for i, s in enumerate(sessions)}  # % of its hits a session loses
    by_id = {r.id: r.session for r in rec.requests}
    cut = {
        k: attrs.evolve(r, cached_l1=r.cached_l1 * (100 - lost[by_id[k]]) // 100, cached_l2=0, cached_l3=0)
        for k, r in base.items()
    }
    low, high = twin_intervals.change_intervals(rec, base, cut, draws=200, seed=seed)["hit_rate"] or (0, 0)
    assert low <= high <= 0.0


def test_jittered_replays_carry_the_node_s_timing_into_the_interval(recorded: Path) -> None:
    """The factors are the twin's own per-request error centred on 1, drawn the same on every run;
    a replay's prefill compute takes that many times longer; the interval is drawn over the
    plain pair and the jittered ones, so a change the jittered replays make and the plain one
    does not lies inside it."""
    import numpy as np

    from hicache.sim import twin_intervals

    rec = twin.read_recording(recorded)
    res = twin.twin(recorded)
    scales = twin_intervals.service_scales(rec, res.records)
    assert scales.size == sum(r.ttft_s is not None for r in rec.requests)
    assert float(np.median(scales)) == pytest.approx(1.0) and (scales >= 0.1).all() and (scales <= 10).all()
    draws = twin_intervals.jitters(rec, scales, replays=3)
    assert draws == twin_intervals.jitters(rec, scales, replays=3) and len(draws) == 3
    assert all(set(d) == {r.id for r in rec.requests} for d in draws)
    sc = twin.scenario(rec, twin.node_facts(rec), res.calibration)
    slow = twin.replay(rec, sc, {r.id: 4.0 for r in rec.requests})
    plain = twin.replay(rec, sc)
    assert sum(r.ttft_s for r in slow.values()) > sum(r.ttft_s for r in plain.values())
    # Sessions lose hits only in the jittered pairs: the interval reaches down to that loss.
    base = res.records
    cut = {k: attrs.evolve(r, cached_l1=0, cached_l2=0, cached_l3=0) for k, r in base.items()}
    lost = twin_intervals.change_intervals(rec, base, base, jittered=[(base, cut)] * 8, draws=900)
    only = twin_intervals.change_intervals(rec, base, base, draws=900)
    assert only["hit_rate"] == pytest.approx((0.0, 0.0), abs=1e-12)
    low, high = lost["hit_rate"] or (0.0, 0.0)
    assert low < -1.0 and high == pytest.approx(0.0, abs=1e-12)
    what = twin.twin(recorded, [f"cache.l1_tokens={32 * PAGE}"])
    assert what.what_if_replays == twin_intervals.REPLAYS + 1
    assert "replay pairs" in twin.report(what) and twin.summary_doc(what)["what_if"]["interval_replays"] == 9


def test_the_command_prints_and_writes_the_comparison(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert cli_main(["sim", "twin", str(recorded), "--out", str(out), "--set", "cache.promise=adaptive"]) == 0
    printed = capsys.readouterr().out
    assert "hit rate" in printed and "what-if" in printed and "tiers equal" in printed
    doc = json.loads((out / "summary.json").read_text())
    for key in ("hit_rate", "ttft_mean_s", "ttft_p90_s", "tpot_mean_s"):
        assert f"predicted_{key}" in doc and f"measured_{key}" in doc
    assert doc["calibration"]["prefill_tokens_per_s"] > 0 and "ttft_residual_rms_s" in doc["calibration"]
    assert doc["what_if"]["overrides"] == ["cache.promise=adaptive"]
    rows = (out / "requests.csv").read_text().splitlines()
    assert rows[0].startswith("id,session,arrival_s,input_length,output_length,measured_l1")
    assert len(rows) == 1 + doc["requests"]


# ============================================================================ bad input


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n', ":1: field"),
        ('{"hicache_trace_header": 2, "block_size": 16}\n', ":1: field 'hicache_trace_header': version 2"),
        ("", ":1: empty file"),
        ('{"hicache_trace_header": 1, "block_size": 0}\n', ":1: field 'block_size'"),
    ],
)
def test_a_bad_header_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expect: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    assert cli_main(["sim", "twin", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"bad.jsonl{expect}" in err


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ({"input_length": 0}, "'input_length'"),
        ({"hash_ids": [1]}, "'hash_ids'"),
        ({"cached_tokens": {"l4": 1}}, "'cached_tokens'"),
        ({"ttft_s": "soon"}, "'ttft_s'"),
        ({"session_id": -1}, "'session_id'"),
        ({"transferred_tokens": 10**6}, "'transferred_tokens'"),
        ({"transferred_tokens": -1}, "'transferred_tokens'"),
        ({"colour": 1}, "'colour'"),
        ({"phases": [0.1]}, "'phases'"),
        ({"phases": {"queue_s": 0.1}}, "'phases'"),
        ({"phases": {"transfer_s": -1}}, "'phases'"),
        ({"phases": {"prefill_compute_s": "1"}}, "'phases'"),
    ],
)
def test_a_bad_request_line_is_named(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], line: dict[str, Any], field: str
) -> None:
    lines = recorded.read_text().splitlines()
    third = {**json.loads(lines[3]), **line}
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([*lines[:3], json.dumps(third), *lines[4:]]) + "\n")
    assert cli_main(["sim", "twin", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"bad.jsonl:4: field {field}" in err


def test_a_recorded_block_size_is_honoured_by_the_trace_reader(recorded: Path) -> None:
    from hicache.scenarios.traces import read_mooncake

    got = read_mooncake(recorded)
    assert got and all(r.block_size == PAGE for r in got)
    assert all(len(r.block_ids or ()) == -(-r.input_length // PAGE) for r in got)


# ============================================================================ a real node (short)


@pytest.mark.process
@pytest.mark.real_model
def test_real_node_the_twin_predicts_the_recorded_tiers_and_the_l2_what_if(tmp_path: Path) -> None:
    """REAL NODE: `hicache serve` (default model, CPU) records 3 chats x 4 turns, one request at a
    time, with an L1 of 12 pages and L2 as large (so turns lose pages the node's L2 cannot keep);
    then the same traffic on a node with L2 doubled. The twin's hit rate must be within a couple of
    pages of the recorded one (one 16-token page is 1.9 points of these 864 prompt tokens), most
    requests' tiers exact, and its what-if of L2 doubled must move the hit rate the way the real
    node moved, by about as much. The recording carries what the fit's transfer term needs: the
    prefill cache's size, and transfers that differ from what prefill computed (turns whose
    history the decode node lost). (Times are compared in bench/twin_check.py, not here.)"""
    from concurrent.futures import ThreadPoolExecutor

    from hicache.runtime.serving.chat_traffic import drop_warmup, record

    traffic = {"l1_pages": 12, "conversations": 3, "turns": 4, "max_new": 8}
    base, doubled = tmp_path / "base.jsonl", tmp_path / "l2x2.jsonl"
    # The two nodes serve at once: one request at a time each, so their decisions do not depend
    # on how fast they run.
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(record, path, ratio=ratio, **traffic) for path, ratio in ((base, 1.0), (doubled, 2.0))
        ]
        for run in runs:
            run.result()
    drop_warmup(base)
    drop_warmup(doubled)
    res = twin.twin(base, ["cache.hicache_ratio=2.0"])
    assert len(res.recording.requests) == 12
    assert twin.node_facts(res.recording).prefill_cache_bytes == twin.PREFILL_CACHE_BYTES
    samples = twin.samples(res.recording)
    assert all(r.transferred is not None for r in res.recording.requests)
    assert sum(s.transferred != s.computed for s in samples) >= twin_calibrate.MIN_ROWS_PER_TERM
    assert abs(res.errors["hit_rate_pp"]) <= 4.0
    assert res.tiers_equal >= 9
    assert res.what_if is not None
    real = twin.overall(twin.read_recording(doubled), None)["hit_rate"] - res.measured["hit_rate"]
    predicted = res.what_if["hit_rate"] - res.predicted["hit_rate"]
    assert real > 0 and predicted > 0  # L2 doubled keeps pages the smaller L2 lost
    assert abs(predicted - real) <= 0.05


def test_a_missing_file_or_an_unwritable_out_is_one_line_and_exit_2(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["sim", "twin", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: cannot read the trace" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli_main(["sim", "twin", str(recorded), "--out", str(blocker)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
