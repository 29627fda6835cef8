"""Tenants never share cached KV: the same tokens under two tenants are two different prefixes.

Page keys are chained from `namespace_seed(model, tenant)`, so two tenants' keys for the same
tokens differ from the first page on, and nothing a tenant left in L1, L2 or L3 can be restored
for another (which would leak one tenant's context into another's replies, and its timing). The
same tenant repeating itself hits every tier. Checked in the core, in the simulator (a scenario
with `workload.tenants = 2` whose conversations share a system prompt), and on real processes.
"""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import trio
from builders import examples
from helpers import start_decode, start_prefill
from hypothesis import given, settings
from kvworld import World
from node_pair import GUARD_S, node_pair
from node_pair import PAGE as PAIR_PAGE

from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.core.pages import namespace_seed, page_keys
from hicache.results import RequestRecord
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire.client import DecodeClient
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import parse_scenario
from hicache.scenarios.workload import WorkItem
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups

MODEL = "test-model"

# ============================================================================ core

PAGE = 4


def keys(tokens: list[int], tenant: str | None) -> list[int]:
    return page_keys(np.asarray(tokens, dtype=np.int64), PAGE, namespace_seed(MODEL, tenant)).tolist()


def serve(w: World, rid: str, tokens: list[int], tenant: str | None) -> tuple[int, int, int, int]:
    """One request of `tenant` through the world until it rests; (l1, l2, l3, transferred)."""
    w.tokens[rid] = list(tokens)
    w.feed(ev.RequestArrived(w.now, rid, len(tokens), keys(tokens, tenant)))
    w.settle()
    assert w.outcomes[rid] == ("finished", "")
    a = w.core.requests[rid].account
    return a.l1, a.l2, a.l3, a.transferred


def config() -> DecodeConfig:
    return DecodeConfig(
        l1_pages=256, l2_pages=512, page_size=PAGE, prefetch_threshold_tokens=PAGE, decode_reserve_tokens=PAGE
    )


@settings(max_examples=examples(150), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=PAGE, max_size=40),
    tenants=st.lists(st.one_of(st.none(), st.text(max_size=6)), min_size=2, max_size=2, unique=True),
    tier=st.sampled_from(["l1", "l2", "l3"]),
)
def test_identical_prompts_of_two_tenants_never_share_a_page(
    tokens: list[int], tenants: list[str | None], tier: str
) -> None:
    owner, other = tenants
    full = len(tokens) // PAGE * PAGE
    mine, theirs = keys(tokens, owner), keys(tokens, other)
    assert not set(mine) & set(theirs)  # the namespaces differ from the first page on

    w = World(config())
    assert serve(w, "first", tokens, owner) == (0, 0, 0, len(tokens))
    # Put the owner's pages on the tier under test (write-through has stored them everywhere).
    if tier == "l2":
        w.feed(ev.EvictRequested(w.now, w.cfg.l1_pages))
        w.settle()
    elif tier == "l3":
        restarted = World(config())
        restarted.l3 = dict(w.l3)  # a new node on the same shared storage
        w = restarted
    assert w.core.tree.peek(mine) == (0 if tier == "l3" else full // PAGE)
    assert w.core.tree.peek(theirs) == 0 and not set(theirs) & set(w.l3)

    assert serve(w, "other", tokens, other) == (0, 0, 0, len(tokens))
    expected = {"l1": (full, 0, 0), "l2": (0, full, 0), "l3": (0, 0, full)}[tier]
    assert serve(w, "again", tokens, owner) == (*expected, len(tokens) - full)


# ============================================================================ simulator


def sim_scenario(tenants: int):
    return parse_scenario(
        {
            "workload": {
                "kind": "multiturn",
                "tenants": tenants,
                "conversations": 6,
                "turns": 2,
                "system_prompt": 1024,  # shared by every conversation, whatever its tenant
                "user_tokens": [64, 256],
                "output_tokens": [16, 64],
                "rate": 2.0,
                "think_time": 1.0,
            },
            "cache": {"page_size": 64, "l1_tokens": 200_000, "prefetch_threshold_tokens": 64},
            "run": {"baselines": ["l1_l2_l3"]},
        },
        "tenants.toml",
    )


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def reuse_bound(items: list[WorkItem], *, same_tenant: bool) -> dict[str, int]:
    """Per request: the longest token prefix (in whole pages) it shares with an earlier request's
    prompt + output, among requests of its own tenant or of any tenant."""
    out: dict[str, int] = {}
    for i, item in enumerate(items):
        best = 0
        for prev in items[:i]:
            if same_tenant and prev.tenant != item.tenant:
                continue
            seq = np.concatenate([prev.prompt, prev.output])  # type: ignore[list-item]
            best = max(best, common_prefix(item.prompt, seq))  # type: ignore[arg-type]
        out[item.id] = min(best, item.prompt_len) // 64 * 64
    return out


def run(items: list[WorkItem], tenants: int) -> dict[str, RequestRecord]:
    setup = setups(sim_scenario(tenants))["l1_l2_l3"]
    return {r.id: r for r in Cluster(setup).run(items, sequential=True).records}


def test_simulated_tenants_with_a_shared_system_prompt_never_hit_each_other() -> None:
    items = build_workload(sim_scenario(2))
    assert {i.tenant for i in items} == {"t0", "t1"}
    records = run(items, 2)
    own = reuse_bound(items, same_tenant=True)
    anyone = reuse_bound(items, same_tenant=False)
    crossing = [i.id for i in items if anyone[i.id] > own[i.id]]
    assert crossing, "no request shares more with another tenant than with its own: the test proves nothing"
    for item in items:
        r = records[item.id]
        assert r.outcome == "finished"
        assert r.cached <= own[item.id], (item.id, item.tenant, r.cached, own[item.id])
        assert r.prefill_cached_tokens <= own[item.id]  # prefill nodes' caches are salted too
    # The first request of the second tenant repeats the first tenant's system prompt and is
    # served as if nothing were cached: no hit, and no faster than alone on a fresh cluster.
    first_t1 = next(i for i in items if i.tenant == "t1")
    assert anyone[first_t1.id] >= 1024 and records[first_t1.id].cached == 0
    alone = run([first_t1], 2)[first_t1.id]
    assert records[first_t1.id].ttft_s >= alone.ttft_s * (1 - 1e-9)
    # With one tenant the same workload does share the system prompt.
    single = build_workload(sim_scenario(1))
    one = run(single, 1)
    second_conversation = next(i for i in single if i.session == first_t1.session and i.turn == 0)
    assert one[second_conversation.id].cached >= 1024
    assert one[second_conversation.id].ttft_s < alone.ttft_s


# ============================================================================ runtime

RT_PAGE = 16


@pytest.mark.process
async def test_runtime_tenants_get_no_hit_from_each_other_on_any_tier(tmp_path: Path) -> None:
    """Tenant "a" asks, then other tenants ask the same tokens while a's pages sit on L1, then
    L2 only, then L3 only: none of them hits anything; "a" itself hits each tier in turn."""
    logs = tmp_path / "logs"
    model = TinyModel(TinyConfig())
    ledger = KVLedger(model, RT_PAGE)
    prompt = np.random.default_rng(11).integers(0, 512, 200).tolist()
    max_new = 8
    full = len(prompt) // RT_PAGE * RT_PAGE
    prefill = await start_prefill(logs, RT_PAGE)
    try:
        args = ["--l1-pages", "256", "--l2-pages", "512"]
        args += ["--storage-dir", str(tmp_path / "l3"), "--prefetch-threshold-tokens", str(RT_PAGE)]
        args += ["--decode-reserve-tokens", "16"]
        decode = await start_decode(prefill, logs, RT_PAGE, *args)
    except BaseException:
        prefill.kill()
        raise
    try:
        client = await DecodeClient.connect("127.0.0.1", decode.port)

        async def ask(rid: str, tenant: str) -> dict[str, int]:
            with trio.fail_after(120):
                reply, kv = await client.generate(rid, prompt, max_new, verify=True, tenant=tenant)
                await client.idle()  # its pages are in the tree, backed up and stored
            assert ledger.check(prompt, max_new, reply, kv, tenant=tenant) == [], reply["reason"]
            return {k: reply["account"][k] for k in ("l1", "l2", "l3", "transferred")}

        cold = {"l1": 0, "l2": 0, "l3": 0, "transferred": len(prompt)}
        assert await ask("a0", "a") == cold
        assert await ask("b", "b") == cold  # a's pages are on L1
        assert await ask("a1", "a") == {**cold, "l1": full, "transferred": len(prompt) - full}
        await client.evict()  # L1 -> L2
        await client.idle()
        assert await ask("c", "c") == cold  # a's pages are on L2 only
        assert await ask("a2", "a") == {**cold, "l2": full, "transferred": len(prompt) - full}
        await client.evict(l1=1 << 40, l2=1 << 40)  # out of L1 and L2: only L3 holds them
        await client.idle()
        assert await ask("d", "d") == cold  # a's pages are in L3 only
        assert await ask("a3", "a") == {**cold, "l3": full, "transferred": len(prompt) - full}
        await client.aclose()
    finally:
        decode.kill()
        prefill.kill()


async def test_prefill_reuses_a_prompt_only_within_its_tenant(tmp_path: Path) -> None:
    """The prefill node remembers recent prompts; another tenant's identical prompt must be
    computed again, or it would come back faster than a new prompt (a timing channel between
    tenants). Counted, not timed: the prefill node's computed prompts."""
    async with node_pair(tmp_path, storage=False) as pair:
        tokens = list(range(30, 30 + 3 * PAIR_PAGE + 2))
        for rid, tenant in (("a0", "a"), ("b0", "b"), ("c0", None)):
            with trio.fail_after(GUARD_S):
                reply, kv = await pair.client.generate(rid, tokens, 2, verify=True, tenant=tenant)
            assert pair.ledger.check(tokens, 2, reply, kv, tenant=tenant) == [], reply["reason"]
        assert pair.prefill.reused_tokens == 0  # one computation per tenant: none served another
        assert pair.prefill.computed_tokens == 3 * len(tokens)
        with trio.fail_after(GUARD_S):
            reply, _ = await pair.client.generate("a1", tokens, 2, tenant="a")
        assert reply["outcome"] == "finished"
        # The same tenant's repeat is remembered: its full pages; the partial last page is computed.
        assert pair.prefill.reused_tokens == 3 * PAIR_PAGE
        assert pair.prefill.computed_tokens == 3 * len(tokens) + 2


async def test_prefill_computes_only_what_extends_a_prompt_of_the_same_tenant(tmp_path: Path) -> None:
    """The next turn of a conversation extends the last prompt: prefill computes only what its
    cache lacks, whole pages as the tree keeps them (its KV checked against a monolithic pass by
    the ledger), and never reuses another tenant's prompt for it."""
    async with node_pair(tmp_path, storage=False) as pair:
        first = list(range(40, 40 + 2 * PAIR_PAGE + 5))
        longer = first + list(range(200, 200 + PAIR_PAGE + 3))
        with trio.fail_after(GUARD_S):
            for rid, tokens, tenant in (("a0", first, "a"), ("b1", longer, "b"), ("a1", longer, "a")):
                before = (pair.prefill.computed_tokens, pair.prefill.reused_tokens)
                reply, kv = await pair.client.generate(rid, tokens, 2, verify=True, tenant=tenant)
                assert pair.ledger.check(tokens, 2, reply, kv, tenant=tenant) == [], reply["reason"]
                done = (pair.prefill.computed_tokens - before[0], pair.prefill.reused_tokens - before[1])
                if rid == "a1":
                    kept = len(first) // PAIR_PAGE * PAIR_PAGE  # the first prompt's full pages
                    assert done == (len(longer) - kept, kept)
                else:
                    assert done == (len(tokens), 0)  # a first prompt, or another tenant's
