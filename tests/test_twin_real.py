"""The digital twin on a recording the real `hicache serve` makes in the test, with serve's
defaults for the recording: three concurrent client workers (tests/concurrent_chat.py) sharing a
system prompt across sessions, prompts of mixed lengths under Mooncake's 512-token block, some
sessions abandoned. The recording keeps the shared prefixes, the twin infers the three clients,
and it predicts the tiers of (nearly) every request, naming each one it does not with a reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from concurrent_chat import play
from helpers import running

from hicache.sim import twin, twin_intervals
from hicache.sim.twin_tiers import REASONS

pytestmark = [pytest.mark.process, pytest.mark.real_model]

PAGE = 16
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("twin-real")
    trace = folder / "concurrent.jsonl"
    args = [
        "--page-size", str(PAGE), "--l1-pages", "24", "--hicache-ratio", "1.0",
        "--decode-reserve-tokens", str(PAGE), "--hicache-storage-backend", "none",
        "--record-trace", str(trace), "--log-dir", str(folder / "logs"),
    ]  # fmt: skip
    with running(*args, command=("serve",), logs=folder, timeout=600, stop_s=60) as proc:
        errors = play(proc.info["url"], MODEL, workers=3, sessions=9, turns=3, max_tokens=8)
    assert errors == []
    return trace


def test_short_prompts_keep_their_shared_prefix(recording: Path) -> None:
    head, *lines = (json.loads(x) for x in recording.read_text().splitlines())
    assert head["block_size"] == head["page_size"] == PAGE  # serve's default: ids per page
    assert all(line["input_length"] < 512 for line in lines)
    firsts = [line for line in lines if "previous_finished" not in line]
    assert len({line["session_id"] for line in firsts}) == 9
    assert len({line["hash_ids"][0] for line in firsts}) == 1  # the system prompt's page, shared
    assert len({tuple(line["hash_ids"]) for line in firsts}) > 1


def test_three_concurrent_clients_are_inferred(recording: Path) -> None:
    rec = twin.read_recording(recording)
    clients = twin.infer_clients(rec)
    assert clients.count == 3 and clients.peak_sessions == 3 and clients.peak_in_flight == 3
    assert clients.from_arrivals and clients.think_max_s is not None and clients.think_max_s >= 0
    later = [r for r in rec.requests if r.previous_finished is not None]
    assert len(later) == 12  # 6 sessions of 3 turns; 3 abandoned after one
    assert all(r.previous_finished <= r.arrival for r in later)  # type: ignore[operator]


def test_the_twin_predicts_the_tiers_in_sample_and_names_every_difference(recording: Path) -> None:
    res = twin.twin(recording)
    n = len(res.recording.requests)
    assert n == 21 and res.replayed_clients == 3
    assert res.tiers_equal >= 0.95 * n, twin.report(res)
    assert len(res.tier_diffs) == n - res.tiers_equal
    assert all(d.reason in REASONS for d in res.tier_diffs)
    if not res.tier_diffs:  # every request's tiers as measured: the hit rate is too
        assert res.errors["hit_rate_pp"] == pytest.approx(0.0, abs=1e-9)


def test_each_request_carries_the_node_s_phases_and_the_fit_uses_them(recording: Path) -> None:
    """Every line says where its time to the KV went, in parts that add up to no more than its
    TTFT (the front door's clock takes in the decode node's); the calibration takes the waits off
    TTFT and fits prefill to its own forwards, on every request, without falling back."""
    lines = [json.loads(x) for x in recording.read_text().splitlines()[1:]]
    for line in lines:
        phases = line["phases"]
        assert set(phases) == set(twin.PHASES) and all(v >= 0 for v in phases.values())
        assert phases["prefill_compute_s"] > 0
        assert sum(phases.values()) <= line["ttft_s"] + 1e-3
    res = twin.twin(recording)
    cal = res.calibration
    assert cal.phased_rows == len(lines) and cal.fallbacks == () and cal.prefill_tokens_per_s > 0
    waits = [sum(line["phases"][k] for k in twin.WAITS) for line in lines]
    assert cal.queued_mean_s == pytest.approx(sum(waits) / len(waits), rel=1e-6)
    assert "fitted to the node's phases on 21 requests" in twin.report(res)


def test_a_what_if_interval_spans_jittered_replays(recording: Path) -> None:
    res = twin.twin(recording, ["cache.l1_tokens=160"])
    assert res.what_if_replays == twin_intervals.REPLAYS + 1 and res.what_if_intervals is not None
    low, high = res.what_if_intervals["hit_rate"] or (1.0, -1.0)
    assert res.what_if is not None and low <= high
