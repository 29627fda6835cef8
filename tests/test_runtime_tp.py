"""A tensor-parallel decode node on real processes: `hicache node decode --tp-size 2`, two ranks
over gloo on loopback, each holding half of the tiny model's KV heads.

The ranks generate the tokens one rank generates; every rank's pages are checked against the
ground truth for its heads; ranks whose L3 shards differ (a page file missing or corrupt on one
rank) take the same shortened plan with identical command sequences; a rank that dies ends the
node on every rank with a line naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import trio
from builders import examples
from helpers import NodeProcess, start_decode, start_prefill
from hypothesis import given, settings

from hicache.core import events as ev
from hicache.core.pages import namespace_seed, page_keys
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.model.tp_model import check_split, head_range
from hicache.runtime.storage.file_store import SUFFIX
from hicache.runtime.tp.tp_kv import heads_field
from hicache.runtime.tp.tp_rounds import Rounds
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire import protocol
from hicache.runtime.wire.client import DecodeClient
from hicache.runtime.wire.compat import shard_heads

PAGE = 16
GUARD_S = 60  # a guard against hangs, never a speed assertion


async def _prefill(logs: Path) -> NodeProcess:
    return await start_prefill(logs, PAGE)


async def _decode(
    prefill: NodeProcess, logs: Path, tp: int, *extra: str, name: str = "decode"
) -> NodeProcess:
    args = ["--l1-pages", "256", "--l2-pages", "512", "--tp-size", str(tp)]
    args += ["--prefetch-threshold-tokens", str(PAGE), "--decode-reserve-tokens", "64", *extra]
    return await start_decode(prefill, logs, PAGE, *args, name=name)


async def _conversation(prefill: NodeProcess, tmp: Path, tp: int) -> list[tuple[list[int], dict]]:
    """Four turns of one conversation — cold, then from L1, from L2 (after an eviction) and
    from L3 (after a restart on the same storage) — each checked by the ledger."""
    logs, storage = tmp / f"logs{tp}", tmp / f"l3-{tp}"
    ledger = KVLedger(TinyModel(TinyConfig()), PAGE)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 512, 120).tolist()
    args = ("--storage-dir", str(storage), "--prefetch-policy", "wait_complete")
    decode = await _decode(prefill, logs, tp, *args)
    out = []
    try:
        client = await DecodeClient.connect("127.0.0.1", decode.port)
        for turn, tier in enumerate(["cold", "l1", "l2", "l3"]):
            if tier == "l2":
                await client.evict()
                await client.idle()
            if tier == "l3":
                await client.idle()
                await client.aclose()
                assert decode.stop() == 0
                decode = await _decode(prefill, logs, tp, *args)
                client = await DecodeClient.connect("127.0.0.1", decode.port)
            with trio.fail_after(GUARD_S):
                reply, kv = await client.generate(f"t{turn}", prompt, 12, verify=True)
            assert ledger.check(prompt, 12, reply, kv) == [], reply["reason"]
            account = reply["account"]
            if tier != "cold":
                assert account[tier] > 0, (tier, account)
            assert len(reply.get("tp_ranks", ())) == tp - 1
            for part in reply.get("tp_ranks", ()):  # every rank restored the same pages
                assert [p["source"] for p in part["start_pages"]] == [
                    p["source"] for p in reply["start_pages"]
                ]
            out.append((reply["tokens"], account))
            prompt = prompt + reply["tokens"] + rng.integers(0, 512, 30).tolist()
        if tp > 1:
            stats = await client.stats()
            assert len(stats["ranks"]) == tp and all(r["l1_pages_used"] > 0 for r in stats["ranks"])
        await client.aclose()
    finally:
        decode.kill()
    return out


@pytest.mark.process
async def test_two_ranks_generate_what_one_generates_with_every_tier_checked_per_rank(tmp_path: Path) -> None:
    prefill = await _prefill(tmp_path / "logs")
    try:
        one = await _conversation(prefill, tmp_path, 1)
        two = await _conversation(prefill, tmp_path, 2)
    finally:
        prefill.kill()
    assert two == one  # tokens and tier accounts, turn by turn
    assert (tmp_path / "l3-2" / "tp2" / "rank0").is_dir() and (tmp_path / "l3-2" / "tp2" / "rank1").is_dir()


def _page_file(storage: Path, rank: int, key: int) -> Path:
    name = f"{key:016x}"
    return storage / "tp2" / f"rank{rank}" / name[:2] / (name + SUFFIX)


@pytest.mark.process
async def test_ranks_with_different_l3_shards_take_the_same_shortened_plan(tmp_path: Path) -> None:
    logs, storage, commands = tmp_path / "logs", tmp_path / "l3", tmp_path / "commands"
    rng = np.random.default_rng(5)
    prompts = {"gone": rng.integers(0, 512, 150).tolist(), "bad": rng.integers(0, 512, 150).tolist()}
    args = ("--storage-dir", str(storage), "--prefetch-policy", "wait_complete")
    prefill = await _prefill(logs)
    try:
        decode = await _decode(prefill, logs, 2, *args)
        client = await DecodeClient.connect("127.0.0.1", decode.port)
        for name, prompt in prompts.items():
            with trio.fail_after(GUARD_S):
                reply, _ = await client.generate(name, prompt, 4)
            assert reply["outcome"] == "finished"
        await client.idle()
        await client.aclose()
        assert decode.stop() == 0
        seed = namespace_seed("tiny", None)
        keys = {n: page_keys(np.asarray(p, dtype=np.int64), PAGE, seed).tolist() for n, p in prompts.items()}
        for key in keys["gone"][3:]:  # rank 1's shard holds 3 pages of the first prompt
            _page_file(storage, 1, key).unlink()
        bad = _page_file(storage, 1, keys["bad"][2])  # present, but fails its check when read
        data = bytearray(bad.read_bytes())
        data[-1] ^= 0xFF
        bad.write_bytes(bytes(data))

        decode = await _decode(prefill, logs, 2, *args, "--command-log", str(commands))
        client = await DecodeClient.connect("127.0.0.1", decode.port)
        accounts = {}
        for name, prompt in prompts.items():
            with trio.fail_after(GUARD_S):
                reply, _ = await client.generate(name + "2", prompt + [1, 2, 3], 4)
            assert reply["outcome"] == "finished", reply["reason"]
            accounts[name] = reply["account"]
        await client.idle()
        await client.aclose()
        assert decode.stop() == 0
    finally:
        prefill.kill()
    assert accounts["gone"]["l3"] == 3 * PAGE and accounts["gone"]["fallback"] == 0
    assert accounts["bad"]["l3"] == 2 * PAGE and accounts["bad"]["fallback"] > 0
    rank0 = (commands / "rank0.log").read_text().splitlines()
    rank1 = (commands / "rank1.log").read_text().splitlines()
    assert rank0 and rank0 == rank1
    assert any(line.startswith("Prefetch(") for line in rank0)


def _gone(pid: int) -> bool:
    """The process ended (or is a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.process
@pytest.mark.parametrize("victim", ["rank 1 killed", "rank 0 killed", "rank 1 stopped"])
async def test_a_dead_or_stuck_rank_ends_every_rank_with_a_line_naming_it(
    tmp_path: Path, victim: str
) -> None:
    logs = tmp_path / "logs"
    prefill = await _prefill(logs)
    try:
        decode = await _decode(prefill, logs, 2, "--collective-timeout", "3")
        (other,) = decode.info["tp_pids"]
        client = await DecodeClient.connect("127.0.0.1", decode.port)
        with trio.fail_after(GUARD_S):
            reply, _ = await client.generate("a", list(range(1, 60)), 4)
        assert reply["outcome"] == "finished"
        pid = decode.proc.pid if victim == "rank 0 killed" else other
        os.kill(pid, signal.SIGSTOP if victim == "rank 1 stopped" else signal.SIGKILL)
        with trio.fail_after(GUARD_S):
            status = await trio.to_thread.run_sync(decode.proc.wait)
            while not _gone(other):
                await trio.sleep(0.05)
        await client.aclose()
    finally:
        decode.kill()
        prefill.kill()
    said = decode.stderr_path.read_text()
    if victim == "rank 1 killed":
        assert status == 3
        assert "hicache node decode: rank 0: rank 1 exited (killed by signal 9) during " in said
    elif victim == "rank 1 stopped":
        assert status == 3
        assert "hicache node decode: rank 0: rank 1 did not join " in said
        assert "within 3 s (it stopped answering)" in said
    else:
        assert "hicache node decode: rank 1: rank 0 is gone" in said


@pytest.mark.process
def test_a_model_whose_kv_heads_do_not_split_is_refused_at_start(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "hicache", "node", "decode", "--prefill", "127.0.0.1:9", "--tp-size", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=GUARD_S)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == ("hicache node decode: --tp-size 3: the model's kv_heads (2) is not a multiple of it")


# ---------------------------------------------------------------------------- merging completions


class _Fed:
    """Stands in for the service and the group: records what a round feeds."""

    def __init__(self, size: int) -> None:
        self.size, self.rank, self.events = size, 0, []

    def put_now(self, event: object, **_: object) -> None:
        self.events.append(event)


OUTCOMES = st.sampled_from(["arrived", "failed", "abandoned"])


@settings(max_examples=examples(200), deadline=None)
@given(
    size=st.integers(2, 4),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["kv", "store"]), st.lists(st.tuples(OUTCOMES, st.integers(0, 3)), min_size=4)
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_a_completion_is_fed_once_every_rank_reported_it_merged_as_the_worst(
    size: int, ops: list[tuple[str, list[tuple[str, int]]]]
) -> None:
    """Ranks report each operation's outcome in any round; it is fed once all have, and only
    then: a transfer arrived only where it arrived on every rank, failed if it failed on one,
    abandoned (then settled, once every abandoning rank settled) if one rank abandoned it; a
    store failed the pages any rank failed."""
    fed = _Fed(size)
    rounds = Rounds(fed, fed, {}, None, tick_interval=0.0)  # type: ignore[arg-type]
    reports: dict[int, list[tuple[int, tuple[str, int], tuple]]] = {}
    for op, (kind, per_rank) in enumerate(ops):
        for rank in range(size):
            outcome, when = per_rank[rank % len(per_rank)]
            if kind == "store":
                done = ("done", (rank,) if outcome == "failed" else ())
                reports.setdefault(when, []).append((rank, ("store", op), done))
                continue
            first = ("arrived", "r") if outcome == "arrived" else (outcome, "r", f"{outcome} here")
            reports.setdefault(when, []).append((rank, ("kv", op), first))
            if outcome == "abandoned":  # settles two rounds later
                reports.setdefault(when + 2, []).append((rank, ("kv", op), ("failed", "r", "settled")))
    last = max(reports)
    for when in range(last + 1):
        for rank, key, outcome in sorted(reports.get(when, ()), key=lambda x: x[0]):
            rounds._pending.setdefault(key, {}).setdefault(rank, []).append(outcome)
        rounds._merge()
    assert not rounds._pending and not rounds._abandoned
    by_op: dict[int, list[object]] = {}
    for e in fed.events:
        by_op.setdefault(getattr(e, "transfer", getattr(e, "op", None)), []).append(e)
    for op, (kind, per_rank) in enumerate(ops):
        outcomes = [per_rank[r % len(per_rank)][0] for r in range(size)]
        got = by_op[op]
        if kind == "store":
            (e,) = got
            assert isinstance(e, ev.StoreDone)
            assert e.failed == tuple(r for r in range(size) if outcomes[r] == "failed")
        elif "abandoned" in outcomes:
            assert [type(e) for e in got] == [ev.KVAbandoned, ev.KVFailed]
        elif "failed" in outcomes:
            assert [type(e) for e in got] == [ev.KVFailed]
            assert got[0].reason.startswith(f"rank {outcomes.index('failed')}: ")
        else:
            assert [type(e) for e in got] == [ev.KVArrived]


# ---------------------------------------------------------------------------- what a rank asks for


def test_a_rank_asks_for_its_heads_and_a_bad_request_is_refused_naming_the_field() -> None:
    cfg = TinyConfig(q_heads=8, kv_heads=4)
    assert [head_range(cfg, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert check_split(cfg, 3) == "--tp-size 3: the model's kv_heads (4) is not a multiple of it"
    assert heads_field({"heads": [2, 4]}, 4) == (2, 4)
    assert heads_field({}, 4) is None
    for bad in ([1, 3], [0, 3], [3, 2], [0, 5], "0-2", [0]):
        with pytest.raises(protocol.MessageError, match="'heads'|heads \\["):
            heads_field({"heads": bad}, 4)
    shard = {"rank": 1, "size": 2, "heads": [2, 4]}
    assert shard_heads({"shard": shard}, 4) is None
    assert "is not a rank's part of 4 KV heads" in shard_heads({"shard": {**shard, "heads": [1, 3]}}, 4)
    assert "is not a rank's part" in shard_heads({"shard": {"rank": 2, "size": 2, "heads": [4, 6]}}, 4)
