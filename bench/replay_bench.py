"""Replay speed of the simulator on Mooncake's conversation trace, and its queueing skeleton
against SimPy 4.

1. The whole `conversation_trace.jsonl` (12,031 requests, 59 minutes of arrivals) through a
   4-prefill / 4-decode cluster with the `l1_l2_l3` baseline (scenario
   `scenarios/mooncake_conversation.toml`): wall time, engine events, events/s, requests/s and
   the multiple of real time.
2. The cluster's queueing skeleton — each request queues at its prefill node (FIFO, service =
   the cost model's prefill time of its whole prompt), then at its decode node's network
   ingress (FIFO, service = its KV bytes over the link), then decodes for output_len steps of a
   batch-of-one step — built in our engine (callbacks) and in SimPy (processes and
   `Resource`s), fed identical service times; both must report the same mean TTFT, and the
   ratio of events per second is printed.

3. With `--memory`: peak RSS (ru_maxrss) and wall time of the 1x trace and of a 10x
   concatenation of it (copies shifted in time and in block ids, so no copy shares a page with
   another; built in a temp dir), each in a fresh process, replayed in memory (`build_workload`,
   records kept) and as `hicache sim run` streams it (`run_streamed`: the trace read a request
   at a time, requests.csv written in order as requests end); the two must give the same
   summary. `--l3-tokens N` caps the shared L3 (unbounded by default, and then it holds every
   page the trace ever had, 11-21 bytes each: what still grows, besides the tally's few
   numbers per request).

    .venv/bin/python bench/replay_bench.py [--trace PATH] [--repeat 3] [--json OUT]
    .venv/bin/python bench/replay_bench.py --memory [--copies 10] [--l3-tokens N] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import simpy

from hicache import compiled
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import load_scenario
from hicache.sim import cluster as cluster_module
from hicache.sim.cluster import Cluster
from hicache.sim.engine import EventLoop
from hicache.sim.runner import run_streamed
from hicache.sim.setup import setups

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "mooncake_conversation.toml"


def full_replay(trace: Path) -> dict:
    scenario = load_scenario(SCENARIO, [f'workload.path="{trace}"', 'run.baselines=["l1_l2_l3"]'])
    items = build_workload(scenario)
    setup = setups(scenario)["l1_l2_l3"]
    # Process setup, not replay work: the first page keys load the compiled key kernel from
    # numba's on-disk cache (0.2-0.3 s, once per process). Every request's keys are still
    # computed inside the timed region.
    items[0].sequence_keys(setup.decode.page_size, setup.model_name)
    # Each repeat starts from a collected heap: the trees of the repeat before (reference
    # cycles) would otherwise be collected inside this one's timed region.
    gc.collect()
    start = time.perf_counter()
    result = Cluster(setup).run(items)
    wall = time.perf_counter() - start  # includes hashing the trace's pages
    s = result.summary
    span = items[-1].arrival - items[0].arrival
    return {
        "requests": s["requests"],
        "completed": s["completed"],
        "wall_s": wall,
        "events": s["events"],
        "core_events": s["core_events"],
        "events_per_s": s["events"] / wall,
        "requests_per_s": s["requests"] / wall,
        "arrival_span_s": span,
        "real_time_multiple": s["simulated_s"] / wall,
        "hit_rate": s["hit_rate"],
    }


def concatenated(trace: Path, copies: int, out: Path) -> Path:
    """`copies` back-to-back copies of a Mooncake trace, each shifted past the one before in
    time (by its span plus one second) and in block ids (by the largest id plus one)."""
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    span = max(r["timestamp"] for r in rows) + 1000
    ids = max(max(r["hash_ids"], default=0) for r in rows) + 1
    with out.open("w") as f:
        for k in range(copies):
            for r in rows:
                shifted = {**r, "timestamp": r["timestamp"] + k * span}
                shifted["hash_ids"] = [i + k * ids for i in r["hash_ids"]]
                f.write(json.dumps(shifted) + "\n")
    return out


def memory_child(trace: Path, mode: str, l3_tokens: int) -> dict:
    """One replay in this (fresh) process: its wall time, peak RSS and summary."""
    sets = [f'workload.path="{trace}"', 'run.baselines=["l1_l2_l3"]']
    if l3_tokens:
        sets.append(f"storage.capacity_tokens={l3_tokens}")
    scenario = load_scenario(SCENARIO, sets)
    setup = setups(scenario)["l1_l2_l3"]
    start = time.perf_counter()
    if mode == "stream":  # as `hicache sim run` replays a streamable trace
        with tempfile.TemporaryDirectory() as tmp:
            result = run_streamed(scenario, Path(tmp) / "requests.csv")[0]["l1_l2_l3"]
    else:
        result = Cluster(setup).run(build_workload(scenario))
    wall = time.perf_counter() - start
    summary = {k: v for k, v in result.summary.items() if k != "wall_s"}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"mode": mode, "wall_s": wall, "peak_rss_mb": peak, "summary": summary}


def memory_bench(trace: Path, copies: int, l3_tokens: int, modes: list[str]) -> list[dict]:
    """1x and `copies`x, each mode in its own process (ru_maxrss is a high-water mark)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        big = concatenated(trace, copies, Path(tmp) / f"conversation_x{copies}.jsonl")
        for label, path in (("1x", trace), (f"{copies}x", big)):
            summaries = {}
            for mode in modes:
                cmd = [sys.executable, __file__, "--child", mode, "--trace", str(path)]
                cmd += ["--l3-tokens", str(l3_tokens)]
                run = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                run["trace"] = label
                s = run["summary"]
                summaries[mode] = s
                out.append(run)
                print(
                    f"{label:>4} {mode:>6}: {s['requests']:,} requests in {run['wall_s']:.1f} s, "
                    f"peak RSS {run['peak_rss_mb']:,.0f} MB, hit rate {s['hit_rate']:.4%}",
                    flush=True,
                )
            if len(summaries) == 2 and summaries["memory"] != summaries["stream"]:
                print(f"{label}: the streamed summary differs from the in-memory one", file=sys.stderr)
                raise SystemExit(1)
    return out


def skeleton(trace: Path) -> tuple[list[float], list[int], list[float], list[float], list[float]]:
    """Arrivals, node index, prefill / network / decode service times of every request."""
    scenario = load_scenario(SCENARIO, [f'workload.path="{trace}"', 'run.baselines=["no_decode_cache"]'])
    items = build_workload(scenario)
    setup = setups(scenario)["no_decode_cache"]
    costs = setup.costs
    kvb = costs.model.kv_bytes_per_token
    arrivals = [i.arrival for i in items]
    nodes = [k % 4 for k in range(len(items))]
    prefill = [costs.prefill_seconds(i.prompt_len) for i in items]
    network = [setup.network_latency + i.prompt_len * kvb / setup.network_bandwidth for i in items]
    decode = [max(0, i.output_len - 1) * costs.step_seconds(1, i.prompt_len) for i in items]
    return arrivals, nodes, prefill, network, decode


def ours(arrivals, nodes, prefill, network, decode) -> tuple[int, float]:
    loop = EventLoop()
    ttft: list[float] = []

    class Fifo:
        __slots__ = ("busy", "queue")

        def __init__(self) -> None:
            self.busy = False
            self.queue: list = []

    pre = [Fifo() for _ in range(4)]
    net = [Fifo() for _ in range(4)]

    def offer(q: Fifo, service: float, then, *args) -> None:
        if q.busy:
            q.queue.append((service, then, args))
        else:
            q.busy = True
            loop.call_after(service, release, q, then, args)

    def release(q: Fifo, then, args) -> None:
        if q.queue:
            service, nxt, nargs = q.queue.pop(0)
            loop.call_after(service, release, q, nxt, nargs)
        else:
            q.busy = False
        then(*args)

    def arrive(i: int) -> None:
        offer(pre[nodes[i]], prefill[i], prefilled, i)

    def prefilled(i: int) -> None:
        offer(net[nodes[i]], network[i], transferred, i)

    def transferred(i: int) -> None:
        ttft.append(loop.now - arrivals[i])
        loop.call_after(decode[i], lambda: None)

    for i, t in enumerate(arrivals):
        loop.call_at(t, arrive, i)
    loop.run()
    return loop.events_run, sum(ttft) / len(ttft)


def with_simpy(arrivals, nodes, prefill, network, decode) -> tuple[int, float]:
    env = simpy.Environment()
    pre = [simpy.Resource(env, 1) for _ in range(4)]
    net = [simpy.Resource(env, 1) for _ in range(4)]
    ttft: list[float] = []

    def request(i: int):
        yield env.timeout(arrivals[i])
        with pre[nodes[i]].request() as r:
            yield r
            yield env.timeout(prefill[i])
        with net[nodes[i]].request() as r:
            yield r
            yield env.timeout(network[i])
        ttft.append(env.now - arrivals[i])
        yield env.timeout(decode[i])

    for i in range(len(arrivals)):
        env.process(request(i))
    steps = 0
    try:
        while True:
            env.step()
            steps += 1
    except simpy.core.EmptySchedule:
        pass
    return steps, sum(ttft) / len(ttft)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--memory", action="store_true", help="peak RSS of 1x and --copies x, see 3.")
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--l3-tokens", type=int, default=0, help="cap the shared L3 (0: unbounded)")
    ap.add_argument("--modes", default="memory,stream", help="which replays --memory runs")
    ap.add_argument("--child", choices=("memory", "stream"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.trace = args.trace.resolve()
    if not args.trace.exists():
        print(f"no trace at {args.trace}", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(memory_child(args.trace, args.child, args.l3_tokens)))
        return 0
    if args.memory:
        runs = memory_bench(args.trace, args.copies, args.l3_tokens, args.modes.split(","))
        if args.json:
            args.json.write_text(json.dumps(runs, indent=2))
        return 0
    runs = [full_replay(args.trace) for _ in range(args.repeat)]
    best = min(runs, key=lambda r: r["wall_s"])
    # `hicache compile`'s build when it matches the sources (HICACHE_PURE=1: plain Python)
    mode = "compiled" if compiled.compiled(cluster_module) else "plain Python"
    print(
        f"full replay (4P/4D, l1_l2_l3, {mode}): {best['requests']:,} requests, "
        f"{best['events']:,} engine events "
        f"({best['core_events']:,} fed to the cores) in {best['wall_s']:.2f} s (best of {args.repeat}: "
        + ", ".join(f"{r['wall_s']:.2f}" for r in runs)
        + f") = {best['events_per_s']:,.0f} events/s, {best['requests_per_s']:,.0f} requests/s, "
        f"{best['real_time_multiple']:,.0f}x real time; hit rate {best['hit_rate']:.1%}"
    )
    model = skeleton(args.trace)
    timings = {}
    for name, fn in (("ours", ours), ("simpy", with_simpy)):
        best_s = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            events, mean_ttft = fn(*model)
            best_s = min(best_s, time.perf_counter() - t)
        timings[name] = {
            "events": events,
            "wall_s": best_s,
            "events_per_s": events / best_s,
            "mean_ttft": mean_ttft,
        }
    o, s = timings["ours"], timings["simpy"]
    if abs(o["mean_ttft"] - s["mean_ttft"]) > 1e-9 * max(1.0, s["mean_ttft"]):
        print(f"the two engines disagree: mean TTFT {o['mean_ttft']} vs {s['mean_ttft']}", file=sys.stderr)
        return 1
    print(
        f"queueing skeleton: ours {o['events']:,} events in {o['wall_s']:.3f} s "
        f"({o['events_per_s']:,.0f}/s), "
        f"SimPy {s['events']:,} events in {s['wall_s']:.3f} s ({s['events_per_s']:,.0f}/s); "
        f"ratio {o['events_per_s'] / s['events_per_s']:.2f}x per event, {s['wall_s'] / o['wall_s']:.2f}x per "
        f"request; same mean TTFT {o['mean_ttft']:.4f} s"
    )
    if args.json:
        args.json.write_text(json.dumps({"full": runs, "skeleton": timings}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
