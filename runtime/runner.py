"""`hicache run SCENARIO --runtime`: a prefill and a decode process on loopback, the scenario's
requests replayed through them and verified, results in the simulator's schema. A scenario's
`[faults]` go to the decode node; after the replay the node's audit (slots, locks, pins, faults
injected and caught) goes into the summary."""

from __future__ import annotations

import tempfile
from pathlib import Path

import trio
from tqdm import tqdm

from hicache.results import format_table, summarize, write_requests_csv, write_summary_json
from hicache.runtime.client import DecodeClient
from hicache.runtime.launch import NodeProcess, start_node
from hicache.runtime.model import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.replay import Replayer
from hicache.runtime.verify import KVLedger
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import Scenario

DEFAULT_L1_TOKENS = 65_536  # when the scenario leaves L1 to be derived from a GPU it models


def node_args(scenario: Scenario, engine: str, storage_dir: Path, prefill_port: int) -> list[str]:
    """The decode node's command line for a scenario's cache section."""
    c = scenario.cache
    page = c.page_size
    l1_tokens = c.l1_tokens or DEFAULT_L1_TOKENS
    l1 = l1_tokens // page
    l2 = c.l2_tokens_for(l1 * page) // page
    return [
        "decode",
        "--engine", engine,
        "--prefill", f"127.0.0.1:{prefill_port}",
        "--page-size", str(page),
        "--l1-pages", str(l1),
        "--l2-pages", str(l2),
        "--storage-dir", str(storage_dir),
        "--promise", c.promise,
        "--prefetch-policy", c.prefetch_policy,
        "--write-policy", c.write_policy,
        "--eviction", c.eviction,
        "--retract-policy", c.retract_policy,
        "--prefetch-threshold-tokens", str(c.prefetch_threshold_tokens),
        "--decode-reserve-tokens", str(c.decode_reserve_tokens),
        "--max-running", str(scenario.cluster.max_running),
        "--tick-interval", str(scenario.cluster.tick_interval),
    ] + (["--faults", scenario.faults.to_arg()] if scenario.faults is not None else [])  # fmt: skip


async def decode_audit(port: int) -> dict:
    """Once the decode node is at rest: what it still holds, and the faults it injected."""
    client = await DecodeClient.connect("127.0.0.1", port)
    try:
        await client.idle()
        reply, _ = await client.call({"op": "audit"})
    finally:
        await client.aclose()
    return {k: v for k, v in reply.items() if k != "op"}


def audit_problems(audit: dict) -> list[str]:
    """What an audit shows the node lost: slots nobody frees, receipts held, requests not ended."""
    out = [f"{k}: {audit[k]}" for k in ("l1_leaked", "l2_leaked", "locks", "pins", "live") if audit.get(k)]
    if audit.get("check", "ok") != "ok":
        out.append(f"check: {audit['check']}")
    return out


def run_scenario(
    scenario: Scenario,
    out: Path,
    *,
    engine: str = "nixl",
    storage_dir: Path | None = None,
    limit: int = 0,
    sequential: bool = False,
    time_scale: float = 1.0,
    verify: bool = True,
    progress: bool = True,
) -> int:
    items = build_workload(scenario)
    if limit:
        items = items[:limit]
    out.mkdir(parents=True, exist_ok=True)
    storage = storage_dir or Path(tempfile.mkdtemp(prefix="l3-", dir=out))
    page = scenario.cache.page_size
    model = TinyModel(TinyConfig())
    ledger = KVLedger(model, page)
    print(
        f"scenario {scenario.name} on the runtime: {len(items)} requests, engine {engine}, "
        f"L3 in {storage}{', one at a time' if sequential else ''}",
        flush=True,
    )

    async def main() -> tuple:
        prefill: NodeProcess | None = None
        decode: NodeProcess | None = None
        try:
            prefill = await start_node(
                ["prefill", "--engine", engine, "--page-size", str(page)], out / "logs", "prefill"
            )
            decode = await start_node(
                node_args(scenario, engine, storage, prefill.port), out / "logs", "decode"
            )
            bar = tqdm(total=len(items), desc="runtime", unit="req", disable=not progress)
            try:
                replayer = Replayer(
                    "127.0.0.1",
                    decode.port,
                    ledger,
                    token_bytes=layout_for(model.config, page).token_bytes,
                    verify=verify,
                    progress=bar.update,
                )
                result = await replayer.run(items, sequential=sequential, time_scale=time_scale)
            finally:
                bar.close()
            audit = await decode_audit(decode.port)
            return result, audit, (decode.stop(), prefill.stop())
        finally:
            for node in (decode, prefill):
                if node is not None:
                    node.kill()

    result, audit, codes = trio.run(main)
    summary = summarize(result.records, events=0, wall_s=result.wall_s, sim_s=result.wall_s)
    summary["verified"] = result.verified
    summary["problems"] = result.problems
    summary["audit"] = audit
    summary["exit_codes"] = {"decode": codes[0], "prefill": codes[1]}
    write_summary_json(out / "summary.json", {"scenario": scenario.to_dict(), "runs": {"runtime": summary}})
    write_requests_csv(out / "requests.csv", [("runtime", result.records)])
    print(format_table({"runtime": summary}))
    print(f"verified {result.verified}/{len(result.records)} requests bit-exact; nodes exited {codes}")
    lost = audit_problems(audit)
    if "faults_injected" in audit:
        print(f"faults injected {audit['faults_injected']}; caught {audit.get('faults_caught', {})}")
    for p in result.problems[:20] + lost:
        print("PROBLEM", p)
    print(f"wrote {out / 'summary.json'}, {out / 'requests.csv'}")
    return 0 if not result.problems and not lost and len(result.records) == len(items) else 1
