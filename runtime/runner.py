"""`hicache run SCENARIO --runtime`: a prefill and a decode process on loopback, the scenario's
requests replayed through them and verified, results in the simulator's schema. A scenario's
`[faults]` go to the decode node; after the replay the node's audit (slots, locks, pins, faults
injected and caught) goes into the summary. Ctrl-C stops the nodes and writes the requests
finished so far; a temporary L3 folder is removed at the end."""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import trio
from tqdm import tqdm

from hicache.results import format_table, summarize, write_requests_csv, write_summary_json
from hicache.runtime import cache_flags
from hicache.runtime.launch import NodeFailed, NodeProcess, start_node
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.replay import Replayer, ReplayResult
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire.client import DecodeClient
from hicache.runtime.wire.protocol import ProtocolError
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import Scenario
from hicache.scenarios.workload import WorkItem

DEFAULT_L1_TOKENS = 65_536  # when the scenario leaves L1 to be derived from a GPU it models


def node_args(scenario: Scenario, engine: str, storage_dir: Path, prefill_port: int) -> list[str]:
    """The decode node's command line for a scenario: every cache, storage and transfer setting
    it states (`cache_flags.scenario_flags`), its faults, and where its L3 and prefill are."""
    l1_tokens = scenario.cache.l1_tokens or DEFAULT_L1_TOKENS
    token_bytes = layout_for(TinyModel(TinyConfig()).config, scenario.cache.page_size).token_bytes
    return [
        "decode",
        "--engine", engine,
        "--prefill", f"127.0.0.1:{prefill_port}",
        *cache_flags.scenario_flags(scenario, l1_tokens, token_bytes),
        "--storage-dir", str(storage_dir),
    ] + (["--faults", scenario.faults.to_arg()] if scenario.faults is not None else [])  # fmt: skip


def prefill_args(scenario: Scenario, engine: str, storage_dir: Path) -> list[str]:
    """The prefill node's command line: with `cluster.prefill_cache` it keeps its own cache and
    reads the L3 the decode node writes when that beats computing, as the simulator's prefill
    nodes do, weighing the read at the scenario's storage bandwidth (fixed, as the decode node's
    estimates are); without, no cache."""
    # KV leaves by layer group during prefill, as the simulator streams it.
    args = ["prefill", "--engine", engine, "--page-size", str(scenario.cache.page_size)]
    args += ["--layer-groups", str(cache_flags.layer_groups(scenario))]
    if not scenario.cluster.prefill_cache:
        return [*args, "--cache-bytes", "0"]
    speed = ["--l3-read-bytes-per-s", repr(float(scenario.storage.bandwidth)), "--fixed-speeds"]
    return [*args, "--storage-dir", str(storage_dir), *speed]


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


# What the replay's connections end in when the nodes stop under it: after Ctrl-C in a terminal
# the nodes (same process group) get the SIGINT too and may close before the replay is cancelled.
_STOPPED_UNDER_US = (
    EOFError,
    OSError,
    ProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    NodeFailed,
)


@attrs.define
class _Run:
    """What a runtime replay got to: filled in as it goes, so an interrupted one still has it."""

    replayer: Replayer | None = None
    result: ReplayResult | None = None
    audit: dict = attrs.Factory(dict)
    codes: tuple[int | None, int | None] = (None, None)
    started: float = 0.0  # when the replay began (perf_counter)
    interrupted: bool = False


@contextlib.contextmanager
def _sigint_cancels(scope: trio.CancelScope, run: _Run) -> Iterator[None]:
    """Ctrl-C cancels `scope` instead of raising KeyboardInterrupt anywhere; `run.interrupted` is
    set in the handler itself, before the loop can see any node go away because of the signal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started with SIGINT ignored (nohup, &)
        yield
        return
    token = trio.lowlevel.current_trio_token()

    def handler(signum: int, frame: object) -> None:
        run.interrupted = True
        token.run_sync_soon(scope.cancel, idempotent=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _only(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    """Whether every error in `exc` (a group, nested or not) is one of `kinds`."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(e, kinds) for e in exc.exceptions)
    return isinstance(exc, kinds)


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
    """Replay `scenario` on a prefill and a decode process. Exit status: 0 when every request
    finished and checked out, 1 if not, 130 after Ctrl-C (the nodes stopped, the requests
    finished so far written). L3 goes to `storage_dir`, else to a temporary folder in `out`
    that is removed at the end."""
    items = build_workload(scenario)
    if limit:
        items = items[:limit]
    out.mkdir(parents=True, exist_ok=True)
    storage = storage_dir or Path(tempfile.mkdtemp(prefix="l3-", dir=out))
    try:
        return _run(scenario, items, out, engine, storage, sequential, time_scale, verify, progress)
    finally:
        if storage_dir is None:  # nodes are stopped by now: nothing writes there any more
            shutil.rmtree(storage, ignore_errors=True)


def _run(
    scenario: Scenario,
    items: list[WorkItem],
    out: Path,
    engine: str,
    storage: Path,
    sequential: bool,
    time_scale: float,
    verify: bool,
    progress: bool,
) -> int:
    page = scenario.cache.page_size
    model = TinyModel(TinyConfig())
    ledger = KVLedger(model, page)
    print(
        f"scenario {scenario.name} on the runtime: {len(items)} requests, engine {engine}, "
        f"L3 in {storage}{', one at a time' if sequential else ''}",
        flush=True,
    )
    run = _Run()

    async def replay(prefill: NodeProcess, decode: NodeProcess) -> None:
        # Every finished request shows (requests take long enough): tqdm's adaptive skipping
        # would hide a count for as long as the next request takes.
        bar = tqdm(
            total=len(items), desc="runtime", unit="req", disable=not progress, miniters=1, mininterval=0
        )
        try:
            run.replayer = Replayer(
                "127.0.0.1",
                decode.port,
                ledger,
                token_bytes=layout_for(model.config, page).token_bytes,
                verify=verify,
                progress=bar.update,
            )
            run.started = time.perf_counter()
            run.result = await run.replayer.run(
                items, sequential=sequential, time_scale=time_scale, clients=scenario.workload.clients
            )
        finally:
            bar.close()
        run.audit = await decode_audit(decode.port)

    async def main() -> None:
        prefill: NodeProcess | None = None
        decode: NodeProcess | None = None
        with trio.CancelScope() as scope, _sigint_cancels(scope, run):
            try:
                prefill = await start_node(prefill_args(scenario, engine, storage), out / "logs", "prefill")
                decode = await start_node(
                    node_args(scenario, engine, storage, prefill.port), out / "logs", "decode"
                )
                await replay(prefill, decode)
                run.codes = (decode.stop(), prefill.stop())
            except BaseException as exc:
                if not (run.interrupted and _only(exc, (*_STOPPED_UNDER_US, trio.Cancelled))):
                    raise
            finally:
                for node in (decode, prefill):
                    if node is None:
                        continue
                    if run.interrupted:
                        node.stop()  # SIGTERM: a clean shutdown, L3 files whole
                    else:
                        node.kill()
            if run.interrupted:
                run.codes = (decode and decode.proc.returncode, prefill and prefill.proc.returncode)

    trio.run(main)
    if run.interrupted:
        return _save_interrupted(scenario, out, run, len(items))
    assert run.result is not None
    result, audit, codes = run.result, run.audit, run.codes
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


def _save_interrupted(scenario: Scenario, out: Path, run: _Run, total: int) -> int:
    """After Ctrl-C: the requests that finished so far, in the usual files, marked interrupted."""
    replayer = run.replayer
    records = sorted(replayer.records, key=lambda r: (r.arrival, r.id)) if replayer is not None else []
    wall = time.perf_counter() - run.started if run.started else 0.0
    summary = summarize(records, events=0, wall_s=wall, sim_s=wall)
    summary["interrupted"] = True
    summary["verified"] = replayer.verified if replayer is not None else 0
    summary["problems"] = list(replayer.problems) if replayer is not None else []
    summary["exit_codes"] = {"decode": run.codes[0], "prefill": run.codes[1]}
    write_summary_json(out / "summary.json", {"scenario": scenario.to_dict(), "runs": {"runtime": summary}})
    write_requests_csv(out / "requests.csv", [("runtime", records)])
    print(
        f"interrupted: {len(records)} of {total} requests finished, nodes stopped; "
        f"wrote {out / 'summary.json'}, {out / 'requests.csv'}",
        file=sys.stderr,
    )
    return 130
