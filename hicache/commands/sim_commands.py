"""What the simulator's commands do: `hicache demo`, `sim run|sweep|report|capacity|twin` and
`trace stats`. The simulator is imported inside each, so that `hicache trace stats` and
`--help` stay quick to start."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hicache.scenarios import __file__ as _scenarios_init
from hicache.scenarios.scenario import load_scenario
from hicache.scenarios.trace_stats import trace_stats
from hicache.scenarios.traces import read_trace

DEMO_SCENARIO = Path(_scenarios_init).parent / "demo.toml"


def run_demo(args: argparse.Namespace) -> int:
    return run_sim(DEMO_SCENARIO, args.overrides, args.out, progress=sys.stderr.isatty())


def run_scenario(args: argparse.Namespace) -> int:
    """`sim run`."""
    return run_sim(args.scenario, args.overrides, args.out, progress=not args.quiet)


def run_twin(args: argparse.Namespace) -> int:
    from hicache.sim import twin
    from hicache.sim.runner import check_out

    if args.out is not None:
        check_out(args.out)  # before replaying: a bad --out costs nothing
    result = twin.twin(
        args.trace, args.overrides, calibrate=not args.no_calibrate, approximate=args.approximate
    )
    print(twin.report(result))
    if args.out is not None:
        for path in twin.write_outputs(args.out, result):
            print(f"wrote {path}")
    return 0


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
    from hicache.scenarios.build import build_workload, why_not_streamed
    from hicache.sim.runner import (
        check_out,
        count_workload,
        run_baselines,
        run_streamed,
        table,
        write_outputs,
    )

    scenario = load_scenario(scenario_path, overrides)
    # A trace that can be read a request at a time is, so that memory does not grow with it.
    if why_not_streamed(scenario) is None:
        items = None
        n, prompt = count_workload(scenario)
    else:
        items = build_workload(scenario)
        n, prompt = len(items), sum(i.prompt_len for i in items)
    out = check_out(out or Path("out") / scenario.name)  # a bad folder is told before simulating
    print(
        f"scenario {scenario.name}: {n:,} requests, {prompt:,} prompt tokens; "
        f"baselines {', '.join(scenario.run.baselines)}",
        flush=True,
    )
    if items is None:
        results, outcomes = run_streamed(scenario, out / "requests.csv", total=n, progress=progress)
    else:
        results, outcomes = run_baselines(scenario, items, progress=progress), None
    print(table(results))
    paths = write_outputs(out, scenario, results, outcomes)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def run_sweep_command(args: argparse.Namespace) -> int:
    from hicache.sim.sweep import make_executor, plan_sweep, run_sweep

    plan = plan_sweep(args.scenario, args.grid, args.overrides, args.repeat)
    executor = make_executor(args.executor, args.workers, args.ray_address)
    out = args.out or Path("out") / f"{plan.base['name']}-sweep"
    sizes = " x ".join(f"{len(g.values)} {g.field}" for g in plan.grids) or "1 configuration"
    seeds = f"{len(plan.seeds)} seed" + ("s" if len(plan.seeds) > 1 else "")
    print(
        f"sweep {plan.base['name']}: {len(plan.runs)} run(s) ({sizes} x {seeds}), "
        f"baselines {', '.join(plan.baselines)}; results in {out}",
        flush=True,
    )
    try:
        outcome = run_sweep(plan, out, executor=executor, resume=args.resume, progress=not args.quiet)
    except KeyboardInterrupt:
        print(
            f"interrupted: finished runs are saved in {out / 'runs'}; continue with --resume", file=sys.stderr
        )
        return 130
    print(f"ran {len(outcome.ran)}, kept {len(outcome.skipped)} saved; wrote {outcome.csv}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from hicache.sim.report import write_report

    print(f"wrote {write_report(args.folder)}")
    return 0


def run_capacity(args: argparse.Namespace) -> int:
    from hicache.results import write_summary_json
    from hicache.sim.capacity import (
        Probe,
        capacity_doc,
        format_capacity,
        parse_slo,
        plan_variants,
        scale_grid,
        search_capacity,
    )

    slo = parse_slo(args.slo)
    scale_grid(args.lo, args.hi, args.tol)  # checks the bounds before anything runs
    variants = plan_variants(args.scenario, args.policies, args.overrides, args.baseline)
    print(
        f"capacity of {', '.join(v.label for v in variants)} ({args.baseline}), "
        f"scales {args.lo:g}..{args.hi:g} within {args.tol:.0%}; SLO {slo.describe()}",
        flush=True,
    )
    results = []
    for variant in variants:

        def show(probe: Probe, label: str = variant.label) -> None:
            if not args.quiet:
                rate = probe.summary.get("request_rate")
                shown = "-" if rate is None else f"{rate:.3f} req/s"
                verdict = "meets" if probe.passed else "misses"
                print(f"  {label}: scale {probe.scale:.4g} ({shown}) {verdict} the SLO", flush=True)

        cap = search_capacity(
            variant, slo, baseline=args.baseline, lo=args.lo, hi=args.hi, tol=args.tol, on_probe=show
        )
        results.append((variant, cap))
    print(format_capacity(results, slo, args.lo))
    out = args.out or Path("out") / f"{variants[0].scenario.name}-capacity"
    out.mkdir(parents=True, exist_ok=True)
    doc = capacity_doc(
        results,
        slo,
        scenario_path=str(args.scenario),
        sets=args.overrides,
        baseline=args.baseline,
        lo=args.lo,
        hi=args.hi,
        tol=args.tol,
    )
    write_summary_json(out / "capacity.json", doc)
    print(f"wrote {out / 'capacity.json'}")
    return 0
