"""The `hicache` command: the one module that wires workloads, the core and the drivers."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from hicache.core.errors import PolicyError
from hicache.core.eviction import EVICTION_POLICIES
from hicache.core.write_policy import WritePolicy
from hicache.demo import DemoReport, replay
from hicache.scenarios.multiturn import MultiTurnChat
from hicache.scenarios.trace_stats import trace_stats
from hicache.scenarios.traces import read_trace


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="replay a generated multi-turn chat workload through a decode node's tiered cache",
        description="Replays the same generated workload with L1 only and with L1 + L2, and shows "
        "where each prompt token came from.",
    )
    demo.add_argument("--conversations", type=_positive, default=200)
    demo.add_argument("--turns", type=_positive, default=5)
    demo.add_argument("--system-prompt", type=int, default=2048, help="tokens shared by every conversation")
    demo.add_argument("--page-size", type=_positive, default=64, help="tokens per page")
    demo.add_argument("--l1-tokens", type=_positive, default=200_000, help="L1 (GPU) capacity in tokens")
    demo.add_argument(
        "--hicache-ratio", type=_non_negative, default=2.0, help="L2 (host) capacity as a multiple of L1"
    )
    demo.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="lru")
    demo.add_argument("--write-policy", choices=[p.value for p in WritePolicy], default="write_through")
    demo.add_argument("--seed", type=int, default=0)
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


def _print_reports(reports: Sequence[DemoReport], page_size: int) -> None:
    header = f"{'config':<8} {'requests':>8} {'L1 hit':>8} {'L2 hit':>8} {'miss':>8} "
    header += f"{'demoted':>9} {'dropped':>9} {'L2 evict':>9} {'backed up':>10}"
    print(header)
    for r in reports:
        print(
            f"{r.label:<8} {r.requests - r.rejected:>8} {r.ratio(r.l1_tokens):>8.1%} "
            f"{r.ratio(r.l2_tokens):>8.1%} {r.ratio(r.missed_tokens):>8.1%} "
            f"{r.demoted_pages * page_size:>9} {r.dropped_pages * page_size:>9} "
            f"{r.host_evicted_pages * page_size:>9} {r.backed_up_pages * page_size:>10}"
        )
    print("(hit ratios are of prompt tokens; page counts are shown in tokens)")


def run_demo(args: argparse.Namespace) -> int:
    workload = MultiTurnChat(
        conversations=args.conversations, turns=args.turns, system_prompt=args.system_prompt, seed=args.seed
    )
    requests = workload.generate()
    l1_pages = args.l1_tokens // args.page_size
    if l1_pages < 1:
        raise SystemExit(f"hicache demo: --l1-tokens must hold at least one page of {args.page_size} tokens")
    l2_pages = int(l1_pages * args.hicache_ratio)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    print(
        f"workload: {len(requests)} requests ({args.conversations} conversations x {args.turns} turns), "
        f"{prompt_tokens:,} prompt tokens; page {args.page_size} tokens; "
        f"L1 {l1_pages * args.page_size:,} tokens, L2 {l2_pages * args.page_size:,} tokens; "
        f"eviction {args.eviction}, {args.write_policy}"
    )
    reports = []
    for label, l2 in (("l1", 0), ("l1_l2", l2_pages)):
        start = time.perf_counter()
        reports.append(
            replay(
                requests,
                label=label,
                page_size=args.page_size,
                l1_pages=l1_pages,
                l2_pages=l2,
                eviction=args.eviction,
                write_policy=args.write_policy,
            )
        )
        elapsed = time.perf_counter() - start
        print(f"  {label}: replayed in {elapsed:.2f} s ({len(requests) / elapsed:,.0f} requests/s)")
    _print_reports(reports, args.page_size)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return run_demo(args)
        if args.command == "trace":
            return run_trace_stats(args)
    except (PolicyError, ValueError) as exc:
        print(f"hicache {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
