"""The fault matrix: every fault on every operation it applies to, in both drivers.

1. Simulator: each (operation, fault) pair at rates 0.1%, 1% and 10%, one at a time, on a
   multi-turn chat of 1,000 requests (the demo scenario with 200 conversations, baseline
   `l1_l2_l3`), plus a run without faults.
2. Runtime: each pair at 10% on a prefill and a decode process over the TCP engine (the
   `hicache run --runtime` replay, 64 requests of a small multi-turn chat), every finished
   request checked bit-exactly; plus a run without faults.

Per cell: requests answered, finished and failed (with the reasons: only a transfer fault may
fail a request), faults injected (and, in the runtime, caught by the page checks), tokens
re-requested from prefill by fallback, the hit rate, slots left owned by anything but the
tree, locks and pins still held, and (runtime) requests that finished with wrong KV. A cell
that breaks a promise is marked `VIOLATION` and makes the script exit with status 1.

    .venv/bin/python bench/fault_matrix.py [--sim-only | --runtime-only] [--jobs N]
                                           [--out DIR] [--write docs/reliability.md]

`--write` replaces the tables between the `fault-matrix` markers of that file.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import multiprocessing
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hicache.faults import APPLIES, OPS
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import Scenario, load_scenario, parse_scenario
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "scenarios" / "demo.toml"
SIM_RATES = (0.001, 0.01, 0.1)
RUNTIME_RATE = 0.1
DELAY_SECONDS = [0.001, 0.05]
PAIRS = [(op, kind) for op in OPS for kind in APPLIES[op]]
RUNTIME_DOC: dict[str, Any] = {
    "name": "fault-matrix-runtime",
    "seed": 0,
    "workload": {
        "kind": "multiturn",
        "conversations": 16,
        "turns": 4,
        "system_prompt": 64,
        "user_tokens": [16, 64],
        "output_tokens": [4, 12],
        "rate": 8.0,
        "think_time": 0.5,
    },
    "cache": {
        "page_size": 16,
        "l1_tokens": 512,
        "hicache_ratio": 2.0,
        "prefetch_threshold_tokens": 32,
        "decode_reserve_tokens": 16,
    },
    "run": {"baselines": ["l1_l2_l3"]},
}


def faults_for(op: str | None, kind: str | None, rate: float) -> dict[str, Any] | None:
    if op is None or kind is None:
        return None
    entry: dict[str, Any] = {"kind": kind, "rate": rate}
    if kind == "delay":
        entry["seconds"] = DELAY_SECONDS
    return {"seed": 0, op: entry}


def reasons(outcomes: list[tuple[str, str]]) -> dict[str, int]:
    """Failure reasons and how often each occurred."""
    return dict(Counter(reason for outcome, reason in outcomes if outcome != "finished").most_common())


def violations(cell: dict[str, Any]) -> list[str]:
    out = []
    if cell["answered"] != cell["requests"]:
        out.append(f"{cell['requests'] - cell['answered']} requests never answered")
    if cell["failed"] and cell["op"] != "transfer":
        out.append(f"{cell['failed']} requests failed by a {cell['op']} fault")
    if any(not r for r in cell["reasons"]):
        out.append("a request failed without a reason")
    for key in ("leaked", "locks", "wrong_kv"):
        if cell.get(key):
            out.append(f"{key} {cell[key]}")
    return out


# ------------------------------------------------------------------------------------ simulator


def sim_scenario(op: str | None, kind: str | None, rate: float) -> Scenario:
    sets = ["workload.conversations=200", 'run.baselines=["l1_l2_l3"]']
    scenario = load_scenario(DEMO, sets)
    doc = scenario.to_dict()
    faults = faults_for(op, kind, rate)
    if faults is not None:
        doc["faults"] = faults
    return parse_scenario(doc, str(DEMO))


def sim_cell(args: tuple[str | None, str | None, float]) -> dict[str, Any]:
    op, kind, rate = args
    scenario = sim_scenario(op, kind, rate)
    items = build_workload(scenario)
    cluster = Cluster(setups(scenario)["l1_l2_l3"])
    result = cluster.run(items)
    s = result.summary
    audits = [d.core.audit() for d in cluster.decode]
    return {
        "op": op,
        "kind": kind,
        "rate": rate if op else 0.0,
        "requests": len(items),
        "answered": len({r.id for r in result.records}),
        "completed": s["completed"],
        "failed": s["failed"],
        "reasons": reasons([(r.outcome, r.reason) for r in result.records]),
        "injected": sum(s.get("faults_injected", {}).values()),
        "fallback_tokens": s["fallback_tokens"],
        "hit_rate": s["hit_rate"],
        "ttft_mean": s["ttft_s"]["mean"],
        "ttft_p99": s["ttft_s"]["p99"],
        "leaked": sum(a["l1_leaked"] + a["l2_leaked"] for a in audits),
        "locks": sum(a["locks"] + a["pins"] for a in audits),
        "wall_s": s["wall_s"],
    }


def run_sim(jobs: int) -> list[dict[str, Any]]:
    cells: list[tuple[str | None, str | None, float]] = [(None, None, 0.0)]
    cells += [(op, kind, rate) for op, kind in PAIRS for rate in SIM_RATES]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        out = []
        for i, cell in enumerate(pool.imap(sim_cell, cells), 1):
            out.append(cell)
            print(f"sim {i}/{len(cells)} {cell['op']} {cell['kind']} {cell['rate']}", file=sys.stderr)
    print(f"simulator: {len(cells)} runs in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return out


def sim_table(cells: list[dict[str, Any]]) -> str:
    base = next(c for c in cells if c["op"] is None)
    head = (
        "| op | fault | injected | failed | fallback tokens | hit rate | TTFT mean s | TTFT p99 s "
        "| leaked slots | locks + pins |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        head,
        f"| — | none | 0 | {base['failed']} | {base['fallback_tokens']:,} | {base['hit_rate']:.1%} "
        f"| {base['ttft_mean']:.3f} | {base['ttft_p99']:.3f} | {base['leaked']} | {base['locks']} |",
    ]
    for op, kind in PAIRS:
        row = [c for c in cells if (c["op"], c["kind"]) == (op, kind)]
        row.sort(key=lambda c: c["rate"])

        def col(key: str, fmt: str, row: list[dict[str, Any]] = row) -> str:
            return " / ".join(format(c[key], fmt) for c in row)

        cols = [
            op,
            kind,
            col("injected", ","),
            col("failed", ","),
            col("fallback_tokens", ","),
            col("hit_rate", ".1%"),
            col("ttft_mean", ".3f"),
            col("ttft_p99", ".3f"),
            str(sum(c["leaked"] for c in row)),
            str(sum(c["locks"] for c in row)),
        ]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ runtime


def runtime_cell(op: str | None, kind: str | None, out: Path) -> dict[str, Any]:
    from hicache.runtime.runner import run_scenario

    doc = dict(RUNTIME_DOC)
    faults = faults_for(op, kind, RUNTIME_RATE)
    if faults is not None:
        doc["faults"] = faults
    scenario = parse_scenario(doc, "fault_matrix.toml")
    folder = out / f"{op or 'none'}-{kind or 'none'}"
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        run_scenario(scenario, folder, engine="tcp", progress=False)
    wall = time.perf_counter() - start
    summary = json.loads((folder / "summary.json").read_text())["runs"]["runtime"]
    with (folder / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    audit = summary["audit"]
    return {
        "op": op,
        "kind": kind,
        "rate": RUNTIME_RATE if op else 0.0,
        "requests": len(build_workload(scenario)),
        "answered": len({r["id"] for r in rows}),
        "completed": summary["completed"],
        "failed": summary["failed"],
        "reasons": reasons([(r["outcome"], r["reason"]) for r in rows]),
        "injected": sum(audit.get("faults_injected", {}).values()),
        "caught": sum(audit.get("faults_caught", {}).values()),
        "fallback_tokens": summary["fallback_tokens"],
        "hit_rate": summary["hit_rate"],
        "leaked": audit["l1_leaked"] + audit["l2_leaked"],
        "locks": audit["locks"] + audit["pins"],
        "live": audit["live"],
        "check": audit["check"],
        "wrong_kv": summary["completed"] - summary["verified"],
        "wall_s": wall,
    }


def run_runtime(out: Path) -> list[dict[str, Any]]:
    cells: list[tuple[str | None, str | None]] = [(None, None), *PAIRS]
    results = []
    start = time.perf_counter()
    for i, (op, kind) in enumerate(cells, 1):
        cell = runtime_cell(op, kind, out)
        results.append(cell)
        print(f"runtime {i}/{len(cells)} {op} {kind}: {cell['wall_s']:.0f} s", file=sys.stderr)
    print(f"runtime: {len(cells)} runs in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return results


def runtime_table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| op | fault | injected | caught by checks | finished | failed | fallback tokens | hit rate "
        "| leaked slots | locks + pins | wrong KV |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        cols = [
            c["op"] or "—",
            c["kind"] or "none",
            c["injected"],
            c["caught"],
            c["completed"],
            c["failed"],
            f"{c['fallback_tokens']:,}",
            f"{c['hit_rate']:.1%}",
            c["leaked"],
            c["locks"],
            c["wrong_kv"],
        ]
        lines.append("| " + " | ".join(str(x) for x in cols) + " |")
    return "\n".join(lines)


def reason_list(cells: list[dict[str, Any]]) -> str:
    seen: Counter[str] = Counter()
    for c in cells:
        seen.update(c["reasons"])
    return "\n".join(f"- {n}× `{reason}`" for reason, n in seen.most_common()) or "- none"


# ------------------------------------------------------------------------------------ output


def replace_between(text: str, name: str, body: str) -> str:
    start, end = f"<!-- fault-matrix:{name} -->", f"<!-- /fault-matrix:{name} -->"
    if start not in text or end not in text:
        raise SystemExit(f"--write: the file has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--sim-only", action="store_true")
    which.add_argument("--runtime-only", action="store_true")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulator processes")
    parser.add_argument("--out", type=Path, default=Path("out/fault_matrix"), help="results folder")
    parser.add_argument("--write", type=Path, default=None, help="a Markdown file with fault-matrix markers")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tables: dict[str, str] = {}
    bad: list[str] = []
    if not args.runtime_only:
        sim = run_sim(args.jobs)
        (args.out / "sim.json").write_text(json.dumps(sim, indent=2) + "\n")
        tables["sim"] = sim_table(sim)
        tables["sim-reasons"] = reason_list(sim)
        bad += [f"sim {c['op']} {c['kind']} {c['rate']}: {v}" for c in sim for v in violations(c)]
    if not args.sim_only:
        rt = run_runtime(args.out / "runtime")
        (args.out / "runtime.json").write_text(json.dumps(rt, indent=2) + "\n")
        tables["runtime"] = runtime_table(rt)
        tables["runtime-reasons"] = reason_list(rt)
        bad += [f"runtime {c['op']} {c['kind']}: {v}" for c in rt for v in violations(c)]
        bad += [f"runtime {c['op']} {c['kind']}: check {c['check']}" for c in rt if c["check"] != "ok"]
        bad += [f"runtime {c['op']} {c['kind']}: {c['live']} live" for c in rt if c["live"]]
    for name, body in tables.items():
        print(f"\n{name}\n\n{body}")
    for line in bad:
        print("VIOLATION", line)
    if args.write is not None:
        text = args.write.read_text()
        for name, body in tables.items():
            text = replace_between(text, name, body)
        args.write.write_text(text)
        print(f"wrote {args.write}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
