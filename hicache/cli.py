"""The `hicache` command: the one module that wires workloads, the core and the drivers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hicache.core.errors import PolicyError
from hicache.scenarios import __file__ as _scenarios_init
from hicache.scenarios.scenario import ScenarioError, load_scenario
from hicache.scenarios.trace_stats import trace_stats
from hicache.scenarios.traces import TraceError, read_trace

DEMO_SCENARIO = Path(_scenarios_init).parent / "demo.toml"


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a scenario field (TOML value syntax; repeatable), e.g. cache.hicache_ratio=4",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="simulate a generated multi-turn chat through all four decode-cache baselines",
        description="Runs the built-in demo scenario (a generated multi-turn chat on one prefill and one "
        "decode node) with no decode cache, L1, L1+L2 and L1+L2+L3, prints the table and writes "
        "summary.json, requests.csv and plots.",
    )
    demo.add_argument(
        "--out", type=Path, default=Path("out/demo"), help="where results go (default out/demo)"
    )
    _add_set(demo)
    sim = sub.add_parser("sim", help="the discrete-event simulator").add_subparsers(
        dest="sim_command", required=True
    )
    run = sim.add_parser(
        "run",
        help="replay a scenario's workload through each of its baselines",
        description="Writes DIR/summary.json, DIR/requests.csv and PNG plots (TTFT CDF, cached tokens by "
        "tier, bytes over the P->D link).",
    )
    run.add_argument("scenario", type=Path, help="a scenario file (TOML)")
    run.add_argument("--out", type=Path, default=None, help="results folder (default out/<scenario name>)")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_set(run)
    trace = sub.add_parser("trace", help="inspect a trace").add_subparsers(
        dest="trace_command", required=True
    )
    stats = trace.add_parser(
        "stats",
        help="requests, duration, length percentiles, blocks, and the ideal prefix-hit ratio",
        description="Reads a Mooncake .jsonl, an Azure .csv, or kv-cache-tester .json file or folder.",
    )
    stats.add_argument("trace", help="the trace file (or a folder of kv-cache-tester sessions)")
    stats.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times by this")
    return parser


def run_trace_stats(args: argparse.Namespace) -> int:
    requests = read_trace(args.trace, time_scale=args.time_scale)
    s = trace_stats(requests)
    print(f"trace            {args.trace}")
    print(f"requests         {s.requests:,}")
    print(f"duration         {s.duration_s / 60:,.1f} min ({s.requests / max(s.duration_s, 1e-9):.2f} req/s)")
    for name, p in (("input tokens", s.input_percentiles), ("output tokens", s.output_percentiles)):
        cols = "  ".join(f"{k} {v:,.0f}" for k, v in p.items())
        print(f"{name:<16} {cols}")
    if s.ideal_hit_ratio is None:
        print("blocks           none (the trace carries no prefix ids)")
    else:
        print(f"blocks           {s.blocks_total:,} total, {s.blocks_distinct:,} distinct")
        print(f"ideal hit        {s.ideal_hit_ratio:.1%} of input tokens (infinite cache, arrival order)")
    return 0


def run_sim(scenario_path: Path, overrides: list[str], out: Path | None, *, progress: bool) -> int:
    # The simulator is imported here so that `hicache trace stats` stays quick to start.
    from hicache.scenarios.build import build_workload
    from hicache.sim.runner import run_baselines, table, write_outputs

    scenario = load_scenario(scenario_path, overrides)
    items = build_workload(scenario)
    prompt = sum(i.prompt_len for i in items)
    print(
        f"scenario {scenario.name}: {len(items):,} requests, {prompt:,} prompt tokens; "
        f"baselines {', '.join(scenario.run.baselines)}",
        flush=True,
    )
    results = run_baselines(scenario, items, progress=progress)
    print(table(results))
    paths = write_outputs(out or Path("out") / scenario.name, scenario, results)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return run_sim(DEMO_SCENARIO, args.overrides, args.out, progress=sys.stderr.isatty())
        if args.command == "sim":
            return run_sim(args.scenario, args.overrides, args.out, progress=not args.quiet)
        if args.command == "trace":
            return run_trace_stats(args)
    except (ScenarioError, TraceError, PolicyError, ValueError) as exc:
        print(f"hicache {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
