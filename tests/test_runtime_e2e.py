"""End to end on real processes: a prefill and a decode node on loopback, over each transfer
engine. A conversation's later turns hit L1, then L2 (after an eviction), then L3 (after the
decode process restarts on the same storage directory); every turn's KV is checked page by page
and against a monolithic forward pass, and its tokens against greedy generation. And the
simulator and the runtime make the same decisions on the same scenario."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import trio
from helpers import NodeProcess, start_decode, start_prefill

from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.runner import run_scenario
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire.client import DecodeClient
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import parse_scenario
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups

pytestmark = pytest.mark.process

PAGE = 16
ENGINES = [
    "tcp",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed"),
    ),
]


async def _decode(engine: str, prefill: NodeProcess, storage: Path, logs: Path) -> NodeProcess:
    args = ["--l1-pages", "256", "--l2-pages", "512", "--storage-dir", str(storage)]
    args += ["--prefetch-threshold-tokens", str(PAGE), "--decode-reserve-tokens", "64"]
    return await start_decode(prefill, logs, PAGE, *args, engine=engine)


@pytest.mark.parametrize("engine", ENGINES)
async def test_turns_hit_l1_then_l2_then_l3_with_bit_exact_kv(engine: str, tmp_path: Path) -> None:
    logs, storage = tmp_path / "logs", tmp_path / "l3"
    model = TinyModel(TinyConfig())
    ledger = KVLedger(model, PAGE)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 512, 200).tolist()
    max_new = 24
    prefill = await start_prefill(logs, PAGE, engine=engine)
    decode = await _decode(engine, prefill, storage, logs)
    try:
        client = await DecodeClient.connect("127.0.0.1", decode.port)
        held = 0  # tokens of the conversation whose KV the node keeps (prompt + output - 1)
        for turn, tier in enumerate(["cold", "l1", "l2", "l3"]):
            if tier == "l2":
                await client.evict()  # L1 -> L2 (write-through already backed it up)
                await client.idle()
            if tier == "l3":
                await client.idle()  # every store has reached the files
                await client.aclose()
                assert decode.stop() == 0  # SIGTERM: a clean shutdown
                decode = await _decode(engine, prefill, storage, logs)
                client = await DecodeClient.connect("127.0.0.1", decode.port)
            with trio.fail_after(120):
                reply, kv = await client.generate(f"turn{turn}", prompt, max_new, verify=True)
            assert ledger.check(prompt, max_new, reply, kv) == [], reply["reason"]
            account = reply["account"]
            want = (min(held, len(prompt)) // PAGE) * PAGE
            got = {"l1": account["l1"], "l2": account["l2"], "l3": account["l3"]}
            expected = {"l1": 0, "l2": 0, "l3": 0}
            if tier != "cold":
                expected[tier] = want
            assert got == expected, (tier, got, want)
            assert account["transferred"] == len(prompt) - want
            assert reply["promised_tokens"] == want
            sources = {p["source"] for p in reply["start_pages"][: want // PAGE]}
            assert sources <= {"cache"}
            await client.idle()
            held = len(prompt) + max_new - 1
            prompt = prompt + reply["tokens"] + rng.integers(0, 512, 40).tolist()
        await client.aclose()
    finally:
        decode.kill()
        prefill.kill()
    # nothing half-written is left in L3: every file there is a whole page
    assert not list(storage.rglob("*.tmp*"))


def _scenario(tmp_path: Path, **workload: object):
    return parse_scenario(
        {
            "workload": {
                "kind": "multiturn",
                "conversations": 3,
                "turns": 3,
                "system_prompt": 64,
                "user_tokens": [16, 80],
                "output_tokens": [4, 24],
                "rate": 4.0,
                "think_time": 1.0,
                **workload,
            },
            # Reading L3 always beats computing, for both prefill nodes: then what prefill finds
            # depends only on what decode stored, not on either side's speed.
            "storage": {"bandwidth": 1e15, "latency": 0.0},
            "cache": {
                "page_size": PAGE,
                "l1_tokens": 1024,
                "hicache_ratio": 2.0,
                "prefetch_threshold_tokens": PAGE,
                "decode_reserve_tokens": 64,
            },
            "run": {"baselines": ["l1_l2_l3"]},
        },
        str(tmp_path / "agree.toml"),
    )


FIELDS = (
    "prompt_tokens",
    "cached_l1",
    "cached_l2",
    "cached_l3",
    "promised_tokens",
    "transferred_tokens",
    "prefill_cached_tokens",
)


def _agree(tmp_path: Path, scenario, *, sequential: bool) -> list:
    items = build_workload(scenario)
    sim = Cluster(setups(scenario)["l1_l2_l3"]).run(items, sequential=sequential).records
    out = tmp_path / "runtime"
    assert run_scenario(scenario, out, engine="tcp", sequential=sequential, progress=False) == 0
    with (out / "requests.csv").open() as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    assert len(rows) == len(sim) == len(items)
    for rec in sim:
        row = rows[rec.id]
        assert {k: int(row[k]) for k in FIELDS} == {k: getattr(rec, k) for k in FIELDS}, rec.id
    assert sum(r.cached for r in sim) > 0  # the scenario does exercise the decode cache
    assert sum(r.prefill_cached_tokens for r in sim) > 0  # and the prefill cache
    return sim


def test_sim_and_runtime_make_the_same_decisions(tmp_path: Path) -> None:
    _agree(tmp_path, _scenario(tmp_path), sequential=True)


def test_sim_and_runtime_agree_on_a_concurrent_closed_loop_replay(tmp_path: Path) -> None:
    """Sessions run at once, each sending its next turn a second after its previous answer. L1
    holds every conversation and they share no prefix (no system prompt), so no eviction, and
    hence no decision, depends on how requests interleave: each turn finds its history in L1 on
    the decode node, and prefill finds the previous prompt in its own tree and the previous
    answer in the L3 decode wrote."""
    sim = _agree(tmp_path, _scenario(tmp_path, arrivals="closed", system_prompt=0), sequential=False)
    assert {r.cached_l2 + r.cached_l3 for r in sim} == {0}
