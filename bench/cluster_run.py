"""Two prefill and two decode nodes, decode node 1 tensor-parallel over 2 ranks (gloo), behind the
front door's router, on the tiny model: a transcript of where each turn of each conversation
went, which decode-side tier its prompt came from, how much of it the prefill node had cached
(own tree or the L3 the decode nodes write), and the ledger's verdict on every rank's pages.

    .venv/bin/python bench/cluster_run.py [--router session_affinity|cache_aware|round_robin]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import trio

from hicache.core.router import ROUTERS, Router
from hicache.runtime.launch import NodeProcess, start_node
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.serving.backend import GenerateRequest, ModelInfo, Sampling
from hicache.runtime.serving.node_backend import NodeBackend
from hicache.runtime.serving.routed_backend import RoutedBackend
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire.client import DecodeClient

PAGE = 16


async def main(router: str, tmp: Path) -> None:
    logs, storage = tmp / "logs", tmp / "l3"
    common = ["--engine", "tcp", "--page-size", str(PAGE)]
    nodes: list[NodeProcess] = []
    try:
        prefill = [
            await start_node(["prefill", *common, "--storage-dir", str(storage)], logs, f"prefill{i}")
            for i in range(2)
        ]
        nodes += prefill
        decode = []
        for i, tp in enumerate((1, 2)):
            args = ["decode", *common, "--prefill", f"127.0.0.1:{prefill[i].port}", "--tp-size", str(tp)]
            args += ["--l1-pages", "256", "--l2-pages", "512", "--storage-dir", str(storage)]
            args += ["--prefetch-threshold-tokens", str(PAGE), "--decode-reserve-tokens", "64"]
            decode.append(await start_node(args, logs, f"decode{i}"))
        nodes += decode
        print(
            f"prefill nodes: {[p.port for p in prefill]}; decode nodes: {[d.port for d in decode]} (tp 1, 2)"
        )
        info = ModelInfo(name="tiny", max_context_tokens=4096, eos_token_ids=(), vocab_size=512)
        backend = RoutedBackend([NodeBackend("127.0.0.1", d.port, info) for d in decode], Router(router, 2))
        clients = [await DecodeClient.connect("127.0.0.1", d.port) for d in decode]
        ledger = KVLedger(TinyModel(TinyConfig()), PAGE)
        rng = np.random.default_rng(5)
        sessions = {n: rng.integers(0, 512, 80).tolist() for n in ("bob", "alice", "dave", "carol")}
        print(f"router {router}\n")
        head = f"{'request':<10} {'node':>4} {'ranks':>5} {'prompt':>6} {'L1':>5} {'L2':>5} {'L3':>5} "
        print(head + f"{'sent':>5} {'P:L1':>5} {'P:L2':>5} {'P:L3':>5}  ledger")
        for turn in range(3):
            if turn == 2:
                await clients[0].evict()  # decode node 0's L1 goes to L2: its next turns restore from there
                await clients[0].idle()
            for sid, prompt in sessions.items():
                req = GenerateRequest(f"{sid}-{turn}", prompt, 6, Sampling(), None, sid)
                node = await backend.choose(req)
                reply, kv = await clients[node].generate(req.rid, prompt, 6, verify=True)
                problems = ledger.check(prompt, 6, reply, kv)
                a, pc = reply["account"], reply.get("prefill_cached") or {}
                ranks = 1 + len(reply.get("tp_ranks", ()))
                tiers = f"{a['l1']:>5} {a['l2']:>5} {a['l3']:>5} {a['transferred']:>5}"
                side = f"{pc.get('l1', 0):>5} {pc.get('l2', 0):>5} {pc.get('l3', 0):>5}"
                verdict = "bit-exact" if not problems else problems[:1]
                print(f"{req.rid:<10} {node:>4} {ranks:>5} {len(prompt):>6} {tiers} {side}  {verdict}")
                sessions[sid] = prompt + reply["tokens"] + rng.integers(0, 512, 20).tolist()
            for c in clients:
                await c.idle()
        print("\nturn 3 sent to the other decode node (and so to a prefill node that never saw it):")
        for sid, prompt in sessions.items():
            node = 1 - await backend.choose(GenerateRequest(sid, prompt, 6, Sampling(), None, sid))
            reply, kv = await clients[node].generate(f"{sid}-3", prompt, 6, verify=True)
            problems = ledger.check(prompt, 6, reply, kv)
            a, pc = reply["account"], reply.get("prefill_cached") or {}
            tiers = f"{a['l1']:>5} {a['l2']:>5} {a['l3']:>5} {a['transferred']:>5}"
            side = f"{pc.get('l1', 0):>5} {pc.get('l2', 0):>5} {pc.get('l3', 0):>5}"
            verdict = "bit-exact" if not problems else problems[:1]
            ranks = 1 + len(reply.get("tp_ranks", ()))
            print(f"{sid + '-3':<10} {node:>4} {ranks:>5} {len(prompt):>6} {tiers} {side}  {verdict}")
        for c in clients:
            await c.aclose()
        await backend.aclose()
    finally:
        for node in reversed(nodes):
            node.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--router", choices=ROUTERS, default="session_affinity")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hicache-cluster-") as tmp:
        trio.run(main, args.router, Path(tmp))
