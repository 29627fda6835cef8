"""Two prefill and two decode nodes, one of them tensor-parallel (2 ranks over gloo), behind the
front door's routed backend: conversations go where their history is (session affinity), later
turns hit the decode node's L1, then L2 after an eviction, every page checked by the ledger per
rank; prefill nodes find earlier prompts in their own trees, and one finds in L3 the answer a
decode node backed up there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
from helpers import NodeProcess, start_decode, start_prefill

from hicache.core.router import Router
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.serving.backend import GenerateRequest, ModelInfo, Sampling
from hicache.runtime.serving.node_backend import NodeBackend
from hicache.runtime.serving.routed_backend import RoutedBackend
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire.client import DecodeClient

pytestmark = pytest.mark.process

PAGE = 16
GUARD_S = 90  # a guard against hangs, never a speed assertion


async def _prefill(logs: Path, storage: Path, name: str) -> NodeProcess:
    args = ["--storage-dir", str(storage)]
    args += ["--l3-read-bytes-per-s", "1e15", "--fixed-speeds"]  # reading L3 always pays here
    return await start_prefill(logs, PAGE, *args, name=name)


async def _decode(prefill: NodeProcess, logs: Path, storage: Path, tp: int, name: str) -> NodeProcess:
    args = ["--l1-pages", "256", "--l2-pages", "512", "--tp-size", str(tp), "--storage-dir", str(storage)]
    args += ["--prefetch-threshold-tokens", str(PAGE), "--decode-reserve-tokens", "64"]
    return await start_decode(prefill, logs, PAGE, *args, name=name)


async def test_two_by_two_with_a_tp2_decode_node_behind_the_router(tmp_path: Path) -> None:
    logs, storage = tmp_path / "logs", tmp_path / "l3"
    ledger = KVLedger(TinyModel(TinyConfig()), PAGE)
    nodes: list[NodeProcess] = []
    try:
        p0 = await _prefill(logs, storage, "prefill0")
        p1 = await _prefill(logs, storage, "prefill1")
        nodes += [p0, p1]
        d0 = await _decode(p0, logs, storage, 1, "decode0")
        d1 = await _decode(p1, logs, storage, 2, "decode1")
        nodes += [d0, d1]
        info = ModelInfo(name="tiny", max_context_tokens=4096, eos_token_ids=(), vocab_size=512)
        backend = RoutedBackend(
            [NodeBackend("127.0.0.1", d.port, info) for d in (d0, d1)], Router("session_affinity", 2)
        )
        checkers = [await DecodeClient.connect("127.0.0.1", d.port) for d in (d0, d1)]
        rng = np.random.default_rng(5)
        names = ("bob", "alice", "dave", "carol")  # two conversations per decode node by their hash
        sessions = {name: rng.integers(0, 512, 70 + 10 * i).tolist() for i, name in enumerate(names)}
        where: dict[str, int] = {}
        accounts: dict[tuple[str, int], dict] = {}
        for turn in range(3):
            for sid, prompt in sessions.items():
                req = GenerateRequest(f"{sid}-{turn}", prompt, 6, Sampling(), None, sid)
                node = await backend.choose(req)
                where.setdefault(sid, node)
                assert where[sid] == node  # a conversation stays where its history is
                if turn == 2 and sid == "bob":  # L1 -> L2 on its node: this turn restores from L2
                    await checkers[node].evict()
                    await checkers[node].idle()
                with trio.fail_after(GUARD_S):
                    reply, kv = await checkers[node].generate(req.rid, prompt, 6, verify=True)
                assert ledger.check(prompt, 6, reply, kv) == [], reply["reason"]  # every rank's pages
                assert len(reply.get("tp_ranks", ())) == (1 if node == 1 else 0)
                accounts[(sid, turn)] = reply
                sessions[sid] = prompt + reply["tokens"] + rng.integers(0, 512, 20).tolist()
            for c in checkers:
                await c.idle()  # backups and stores done before the next turn
        assert set(where.values()) == {0, 1}  # both decode nodes serve
        for (sid, turn), reply in accounts.items():
            acct = reply["account"]
            if turn == 0:
                assert acct["l1"] + acct["l2"] + acct["l3"] == 0
            elif turn == 2 and where[sid] == where["bob"]:  # its node's L1 went to L2 before
                assert acct["l2"] > 0, (sid, acct)
            else:
                assert acct["l1"] > 0, (sid, turn, acct)
            if turn > 0:  # prefill finds at least the previous prompt's pages in its own tree
                assert sum(reply["prefill_cached"].values()) > 0, (sid, turn, reply["prefill_cached"])
        # A conversation moved to the other side: its new prefill node has never seen it, and
        # finds the history that decode node 0 (one rank: unsharded pages) stored in L3.
        moved = next(sid for sid, n in where.items() if n == 0)
        prompt = sessions[moved]
        with trio.fail_after(GUARD_S):
            reply, kv = await checkers[1].generate(f"{moved}-moved", prompt, 6, verify=True)
        assert ledger.check(prompt, 6, reply, kv) == [], reply["reason"]
        # Prefill node 1 never computed this history, so whatever it had cached came through L3
        # (each rank asks for its heads: the first request reads L3, the other finds it in L1).
        # Decode node 0 stored the last turn's prompt and answer but its last token (no KV yet).
        stored = (len(prompt) - 20 - 1) // PAGE * PAGE
        assert sum(reply["prefill_cached"].values()) >= stored, (stored, reply["prefill_cached"])
        for c in checkers:
            await c.aclose()
        await backend.aclose()
    finally:
        for node in reversed(nodes):
            node.kill()
