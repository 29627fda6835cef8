"""Validation studies: the simulator's figures beside published ones (see docs/validation.md).

    .venv/bin/python bench/validate.py hit-ratio     [--json OUT] [--capacities 1,3,10,30,50,100]
    .venv/bin/python bench/validate.py multiturn-pr  [--json OUT] [--no-sensitivity]
    .venv/bin/python bench/validate.py break-even    [--json OUT]

- `hit-ratio`: the ideal prefix-hit ratio of Mooncake's traces (their paper: 40% and 66%), an
  LRU cache of C tokens replayed on the trace alone (the shape of their Fig. 9), and the decode
  node's hit ratio in the simulator against its capacity (L1 only, L1+L2; 1 and 4 decode nodes
  behind the cache-aware router).
- `multiturn-pr`: SGLang PR #26227's 6-round benchmark (prompts 4K -> 64K on a 32B Qwen, PD +
  HiCache + a Mooncake store), replayed closed-loop as its scenario says (a client sends its
  next round when the previous answer is back), `no_decode_cache` against `l1_l2_l3`, per round
  and overall, with the sensitivity to the settings the PR does not state.
- `break-even`: the storage bandwidth at which loading a stored prefix beats the alternative:
  Mooncake's closed form (load vs prefill recompute, LLaMA3-70B, 8K prefix), the same from our
  cost model, the decode node's `adaptive` rule (an L3 restore that fits within prefill plus
  the whole P->D transfer) against `eager` and no decode cache, and both shown in simulation
  by sweeping `storage.bandwidth`.

Each study prints its tables; `--json OUT` also writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from hicache.results import RequestRecord
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import Scenario, load_scenario
from hicache.scenarios.trace_stats import trace_stats
from hicache.scenarios.traces import TraceRequest, read_trace
from hicache.scenarios.workload import WorkItem
from hicache.sim.cluster import Cluster, ClusterSetup, RunResult
from hicache.sim.costs import NodeCosts
from hicache.sim.geometry import model_preset
from hicache.sim.hardware import gpu_preset, link_preset
from hicache.sim.runner import run_baselines
from hicache.sim.setup import setups

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"

# ============================================================================ shared helpers


def scenario(name: str, overrides: Sequence[str] = ()) -> Scenario:
    return load_scenario(SCENARIOS / name, list(overrides))


def setup_of(sc: Scenario, baseline: str) -> ClusterSetup:
    return setups(attrs.evolve(sc, run=attrs.evolve(sc.run, baselines=(baseline,))))[baseline]


@attrs.frozen(slots=True)
class KeyedItem(WorkItem):
    """A work item whose page keys are computed once and reused by every run of a sweep (the
    keys depend only on the page size and the model's namespace)."""

    keys: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)
    keys_for: tuple[int, str] = (0, "")

    def sequence_keys(self, page_size: int, model: str) -> np.ndarray:
        if self.keys is not None and self.keys_for == (page_size, model):
            return self.keys
        return WorkItem.sequence_keys(self, page_size, model)


def with_keys(items: Sequence[WorkItem], page_size: int, model: str) -> list[KeyedItem]:
    fields = {f.name for f in attrs.fields(WorkItem)}
    return [
        KeyedItem(
            **{k: getattr(i, k) for k in fields},
            keys=i.sequence_keys(page_size, model),
            keys_for=(page_size, model),
        )
        for i in items
    ]


def mean(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return float(np.mean(vals)) if vals else math.nan


def pct(values: Sequence[float], q: float) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return float(np.percentile(vals, q)) if vals else math.nan


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.3g}" if abs(v) < 1e-2 and v else f"{v:,.2f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def _plain(value: Any) -> Any:
    """JSON-safe data: tuples become lists, keys strings, and a non-finite number (a break-even
    that does not exist) null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    return value


def write_json(path: Path | None, doc: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(doc), indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {path}")


# ============================================================================ study 1: hit ratio

# Mooncake FAST'25, Table 2 (cache ratio with an infinite cache) and Fig. 9 (hit ratio against
# local cache capacity: "3M tokens reach < 50% of the maximum", "~50M tokens approach it").
PUBLISHED_IDEAL = {"conversation": 0.40, "synthetic": 0.66}
TRACE_SCENARIOS = {
    "conversation": "validation_capacity_conversation.toml",
    "synthetic": "validation_capacity_synthetic.toml",
}


def lru_hit_ratio(requests: Sequence[TraceRequest], capacity_tokens: int) -> float:
    """Hit ratio of one LRU cache of whole blocks fed by the trace alone: a request hits its
    leading blocks the cache holds, then all its blocks become most recent (inserted at
    arrival, as in the ideal). Mooncake's Fig. 9 is this kind of replay."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    cap = None
    for r in sorted(requests, key=lambda r: r.arrival):
        ids, block = r.block_ids, r.block_size
        assert ids is not None and block is not None
        cap = capacity_tokens // block if cap is None else cap
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        hit += min(n * block, r.input_length)
        total += r.input_length
        for b in ids:
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
        while len(cache) > cap:
            cache.popitem(last=False)
    return hit / total if total else 0.0


# Four nodes of 30M tokens already hold more than either trace's working set (93.6M and 22.5M
# tokens): larger capacities would only repeat the saturated hit ratio.
FOUR_NODE_MAX = 30_000_000


def _capacity_runs(capacities: Sequence[int]) -> list[tuple[str, int, int, int, int]]:
    """(label, decode nodes, capacity, l1 tokens, l2 tokens) per run; L1+L2 splits the capacity
    as SGLang's default hicache_ratio 2 does (L2 = 2 x L1)."""
    runs = []
    for nodes in (1, 4):
        for c in capacities:
            if nodes > 1 and c > FOUR_NODE_MAX:
                continue
            runs.append(("l1", nodes, c, c, 0))
            runs.append(("l1_l2", nodes, c, c // 3, c - c // 3))
    return runs


def study_hit_ratio(args: argparse.Namespace) -> dict[str, Any]:
    capacities = [int(float(c) * 1e6) for c in args.capacities.split(",")]
    out: dict[str, Any] = {"capacities_tokens": capacities, "traces": {}}
    for trace, file in TRACE_SCENARIOS.items():
        base = scenario(file)
        requests = read_trace(base.workload.path)
        stats = trace_stats(requests)
        totals = sorted({n * c for _, n, c, _, _ in _capacity_runs(capacities)})
        lru = {c: lru_hit_ratio(requests, c) for c in totals}
        doc: dict[str, Any] = {
            "requests": stats.requests,
            "ideal_hit": stats.ideal_hit_ratio,
            "published_ideal_hit": PUBLISHED_IDEAL[trace],
            "lru_hit": lru,
            "sim": [],
        }
        ideal = stats.ideal_hit_ratio or 0.0
        paper = PUBLISHED_IDEAL[trace]
        print(f"\n=== {trace}: {stats.requests:,} requests, ideal hit {ideal:.1%} (paper {paper:.0%})")
        page = base.cache.page_size
        items = with_keys(build_workload(base), page, setup_of(base, "l1").model_name)
        rows = []
        for label, nodes, cap, l1, l2 in _capacity_runs(capacities):
            overrides = [
                f"cluster.decode_nodes={nodes}",
                f"cache.l1_tokens={l1}",
                f'run.baselines=["{label}"]',
            ]
            if l2:
                overrides.append(f"cache.l2_tokens={l2}")
            sc = scenario(file, overrides)
            t0 = time.perf_counter()
            res = Cluster(setup_of(sc, label)).run(items)
            wall = time.perf_counter() - t0
            s = res.summary
            hit = s["hit_rate"]
            row = {
                "tiers": label,
                "decode_nodes": nodes,
                "capacity_tokens": cap,
                "l1_tokens": l1,
                "l2_tokens": l2,
                "hit": hit,
                "hit_l1": s["cached_tokens"]["l1"] / max(s["prompt_tokens"], 1),
                "hit_l2": s["cached_tokens"]["l2"] / max(s["prompt_tokens"], 1),
                "share_of_ideal": hit / ideal if ideal else math.nan,
                "lru_hit_same_total": lru[nodes * cap],
                "wall_s": wall,
            }
            doc["sim"].append(row)
            rows.append(
                [
                    label,
                    nodes,
                    f"{cap / 1e6:g}M",
                    f"{l1 / 1e6:.3g}M+{l2 / 1e6:.3g}M",
                    f"{hit:.1%}",
                    f"{row['hit_l2']:.1%}",
                    f"{hit / ideal:.0%}",
                    f"{lru[nodes * cap]:.1%}",
                    f"{lru[nodes * cap] / ideal:.0%}",
                    round(wall, 1),
                ]
            )
            print(
                f"  ran {label} x{nodes} at {cap / 1e6:g}M tokens: hit {hit:.1%} ({wall:.1f} s)", flush=True
            )
        print_table(
            [
                "tiers",
                "nodes",
                "capacity",
                "L1+L2",
                "hit",
                "of it L2",
                "of ideal",
                "LRU, total",
                "of ideal",
                "wall s",
            ],
            rows,
            f"{trace}: decode-side hit ratio against capacity per decode node (ideal {ideal:.1%})",
        )
        out["traces"][trace] = doc
    return out


# ============================================================================ study 2: PR #26227

# SGLang PR #26227, "Speed Tests and Profiling" (Qwen32B + PD + HiCache + Mooncake).
PR_ROUNDS = [  # round: (prompt K tokens, TTFT no decode radix, TTFT decode L2+L3, hit none, hit L2+L3)
    (4, 2.29, 1.59, 0.000, 0.000),
    (16, 7.25, 5.56, 0.250, 0.750),
    (28, 12.72, 9.19, 0.571, 0.857),
    (40, 18.01, 11.93, 0.700, 0.900),
    (52, 23.40, 12.52, 0.769, 0.923),
    (64, 28.50, 15.18, 0.812, 0.937),
]
PR_TOTAL = {
    "ttft_mean": (15.36, 9.33),
    "ttft_p90": (36.46, 19.30),
    "ttft_p99": (48.87, 23.51),
    "hit": (0.686, 0.882),
    "tpot_ms": (40.31, 41.32),
}
PR_SCENARIO = "validation_pr_multiturn.toml"


def _per_round(records: Sequence[RequestRecord]) -> list[dict[str, float]]:
    rounds: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in records:
        rounds[r.turn].append(r)
    out = []
    for turn in sorted(rounds):
        rs = [r for r in rounds[turn] if r.outcome == "finished"]
        prompt = sum(r.prompt_tokens for r in rs) or 1
        out.append(
            {
                "round": turn,
                "prompt_tokens": prompt / max(len(rs), 1),
                "ttft_s": mean([r.ttft_s for r in rs]),
                "decode_hit": sum(r.cached for r in rs) / prompt,
                "prefill_hit": sum(r.prefill_cached_tokens for r in rs) / prompt,
            }
        )
    return out


def _totals(res: RunResult) -> dict[str, float]:
    rs = [r for r in res.records if r.outcome == "finished"]
    prompt = sum(r.prompt_tokens for r in rs) or 1
    ttft = [r.ttft_s for r in rs]
    return {
        "requests": len(res.records),
        "completed": len(rs),
        "ttft_mean": mean(ttft),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "tpot_ms": 1e3 * mean([r.tpot_s for r in rs]),
        "decode_hit": sum(r.cached for r in rs) / prompt,
        "decode_hit_l1": sum(r.cached_l1 for r in rs) / prompt,
        "decode_hit_l2": sum(r.cached_l2 for r in rs) / prompt,
        "decode_hit_l3": sum(r.cached_l3 for r in rs) / prompt,
        "prefill_hit": sum(r.prefill_cached_tokens for r in rs) / prompt,
        "pd_gb": sum(r.pd_transfer_bytes for r in res.records) / 1e9,
        "fallback_tokens": sum(r.fallback_tokens for r in res.records),
        "simulated_s": res.summary["simulated_s"],
    }


def run_pr(overrides: Sequence[str]) -> dict[str, Any]:
    """The scenario as `hicache sim run` replays it: closed-loop clients (`arrivals = "closed"`)."""
    results = run_baselines(scenario(PR_SCENARIO, overrides))
    return {
        baseline: {"total": _totals(res), "rounds": _per_round(res.records)}
        for baseline, res in results.items()
    }


def _change(a: float, b: float) -> str:
    return f"{(b - a) / a:+.1%}" if a else "-"


SENSITIVITY: list[tuple[str, list[str]]] = [
    ("clients 16", ["workload.conversations=16"]),
    ("clients 48", ["workload.conversations=48"]),
    ("TP4 nodes (4 x H20)", ["hardware.gpus_per_node=4"]),
    ("L3 5 GB/s", ["storage.bandwidth=5e9"]),
    ("L3 1 GB/s", ["storage.bandwidth=1e9"]),
    ("P->D 0.6 GB/s, 4 clients", ["hardware.network_bandwidth=0.075e9", "workload.conversations=4"]),
    (
        "P->D 0.6, L3 1 GB/s, 4 cl.",
        ["hardware.network_bandwidth=0.075e9", "workload.conversations=4", "storage.bandwidth=1e9"],
    ),
    # One connection per transfer capped at 0.6 GB/s beside the shared 200 GB/s link (the rate
    # the PR's no-cache TTFT slope implies), all 32 clients.
    ("0.6 GB/s per transfer", ["hardware.transfer_rate=0.6e9"]),
    ("KV sent after prefill", ["cluster.layerwise_transfer=false"]),
    (
        "0.6 GB/s/transfer, after",
        ["hardware.transfer_rate=0.6e9", "cluster.layerwise_transfer=false"],
    ),
    ("think 10 s", ["workload.think_time=10.0"]),
    ("8 x H800", ['hardware.gpu="h800"']),
    ("MFU 0.35", ["hardware.efficiency=0.35"]),
    # SGLang's decode-side HiCache polling before sgl-project/sglang#30511: 4 all-reduces of
    # ~150 us per decode step (one after it); cluster.hicache_step_overhead charges it.
    ("HiCache 0.6 ms/step", ["cluster.hicache_step_overhead=0.6e-3"]),
]


def study_multiturn_pr(args: argparse.Namespace) -> dict[str, Any]:
    base = run_pr(args.set)
    nc, l3 = base["no_decode_cache"], base["l1_l2_l3"]
    rows = []
    for i, (k, t_none, t_l3, h_none, h_l3) in enumerate(PR_ROUNDS):
        a, b = nc["rounds"][i], l3["rounds"][i]
        rows.append(
            [
                i,
                f"{k}K",
                f"{a['prompt_tokens'] / 1024:.0f}K",
                f"{t_none:.2f} -> {t_l3:.2f}",
                f"{a['ttft_s']:.2f} -> {b['ttft_s']:.2f}",
                _change(t_none, t_l3),
                _change(a["ttft_s"], b["ttft_s"]),
                f"{h_none:.3f} -> {h_l3:.3f}",
                f"{a['prefill_hit']:.3f} -> {b['prefill_hit']:.3f}",
                f"{b['decode_hit']:.3f}",
            ]
        )
    print_table(
        [
            "round",
            "PR len",
            "our len",
            "PR TTFT s",
            "our TTFT s",
            "PR chg",
            "our chg",
            "PR hit",
            "our P hit",
            "our D hit",
        ],
        rows,
        "per round: no_decode_cache -> l1_l2_l3 (P hit: prefill-side cached share; D hit: decode-side)",
    )
    a, b = nc["total"], l3["total"]
    tot_rows = []
    for key, label in (
        ("ttft_mean", "mean TTFT s"),
        ("ttft_p90", "P90 TTFT s"),
        ("ttft_p99", "P99 TTFT s"),
        ("tpot_ms", "mean TPOT ms"),
    ):
        pa, pb = PR_TOTAL[key]
        tot_rows.append(
            [
                label,
                f"{pa:.2f} -> {pb:.2f}",
                _change(pa, pb),
                f"{a[key]:.2f} -> {b[key]:.2f}",
                _change(a[key], b[key]),
            ]
        )
    pa, pb = PR_TOTAL["hit"]
    tot_rows.append(
        [
            "hit rate (prefill side)",
            f"{pa:.3f} -> {pb:.3f}",
            f"{(pb - pa) * 100:+.1f} pp",
            f"{a['prefill_hit']:.3f} -> {b['prefill_hit']:.3f}",
            f"{(b['prefill_hit'] - a['prefill_hit']) * 100:+.1f} pp",
        ]
    )
    tot_rows.append(
        [
            "hit rate (decode side)",
            "-",
            "-",
            f"{a['decode_hit']:.3f} -> {b['decode_hit']:.3f}",
            f"L1 {b['decode_hit_l1']:.3f} L2 {b['decode_hit_l2']:.3f} L3 {b['decode_hit_l3']:.3f}",
        ]
    )
    tot_rows.append(
        ["P->D GB", "-", "-", f"{a['pd_gb']:.0f} -> {b['pd_gb']:.0f}", _change(a["pd_gb"], b["pd_gb"])]
    )
    print_table(["metric", "PR", "PR chg", "ours", "our chg"], tot_rows, "overall")
    out: dict[str, Any] = {
        "published": {"rounds": PR_ROUNDS, "total": PR_TOTAL},
        "base": base,
        "sensitivity": {},
    }
    if args.no_sensitivity:
        return out
    sens_rows = [["(base)", *_sens_cells(base)]]
    for label, overrides in SENSITIVITY:
        t0 = time.perf_counter()
        res = run_pr([*args.set, *overrides])
        out["sensitivity"][label] = {"overrides": overrides, **res}
        sens_rows.append([label, *_sens_cells(res)])
        print(f"  ran {label} ({time.perf_counter() - t0:.1f} s)", flush=True)
    sens_rows.append(["PR #26227", "15.36 -> 9.33", "-39.3%", "-51.9%", "0.686 -> 0.882", "+2.5%", "-"])
    print_table(
        ["setting", "mean TTFT s", "chg", "P99 chg", "prefill hit", "TPOT chg", "D hit L1/L2/L3"],
        sens_rows,
        "sensitivity: no_decode_cache -> l1_l2_l3 under settings the PR does not state",
    )
    return out


def _sens_cells(res: dict[str, Any]) -> list[str]:
    a, b = res["no_decode_cache"]["total"], res["l1_l2_l3"]["total"]
    return [
        f"{a['ttft_mean']:.2f} -> {b['ttft_mean']:.2f}",
        _change(a["ttft_mean"], b["ttft_mean"]),
        _change(a["ttft_p99"], b["ttft_p99"]),
        f"{a['prefill_hit']:.3f} -> {b['prefill_hit']:.3f}",
        _change(a["tpot_ms"], b["tpot_ms"]),
        f"{b['decode_hit_l1']:.2f}/{b['decode_hit_l2']:.2f}/{b['decode_hit_l3']:.2f}",
    ]


# ============================================================================ study 3: break-even

BE_SCENARIO = "validation_break_even.toml"
PREFIX = 8192  # Mooncake's example: an 8K prefix
BANDWIDTHS_GBS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 24, 32, 48, 64]


def mooncake_break_even(gpu_flops: float, prefix: int = PREFIX) -> float:
    """Mooncake's condition for reusing a stored prefix of p tokens (FAST'25, Sec. 5, Table 1):
    B / G > 2 d s / (gqa (a p d + b d^2)), LLaMA3-70B: d = 8192, s = 2 bytes, gqa = 8, a = 4,
    b = 22; G = the node's peak FLOP/s. Returns B in bytes/s."""
    d, s, gqa, a, b = 8192, 2, 8, 4, 22
    return gpu_flops * 2 * d * s / (gqa * (a * prefix * d + b * d * d))


def prefill_break_even(costs: NodeCosts, host_bw: float, latency: float, prefix: int = PREFIX) -> float:
    """Our prefill node's rule: read the prefix from L3 when latency + X/B + X/H (storage, then
    the host link) is below computing it again; the B at which both are equal."""
    x = prefix * costs.model.kv_bytes_per_token
    left = costs.prefill_seconds(prefix) - latency - x / host_bw
    return x / left if left > 0 else math.inf


def adaptive_break_even(
    costs: NodeCosts,
    net_bw: float,
    host_bw: float,
    net_lat: float,
    l3_lat: float,
    prompt: int,
    prefix: int,
    groups: int = 0,
) -> float:
    """The decode node's `adaptive` promise keeps an L3 span of X bytes (`prefix` tokens) when its
    restore, l3_latency + X/B + X/H, fits within the overlap window: the time the transfer of
    the whole prompt takes to land, network_latency + P + T after prefill (P) when sent once it
    is done, network_latency + max(P/G + T, P + T/G) when streamed in G layer groups during it
    (T = prompt/N). The B at which both are equal."""
    kvb = costs.model.kv_bytes_per_token
    x = prefix * kvb
    prefill, transfer = costs.prefill_seconds(prompt), prompt * kvb / net_bw
    window = max(prefill / groups + transfer, prefill + transfer / groups) if groups else prefill + transfer
    left = net_lat + window - l3_lat - x / host_bw
    return x / left if left > 0 else math.inf


def eager_crossing(
    costs: NodeCosts,
    net_bw: float,
    host_bw: float,
    l3_lat: float,
    prompt: int,
    prefix: int,
    groups: int = 0,
) -> float:
    """The L3 bandwidth below which eager restore makes TTFT worse than no decode cache, to first
    order: the restore (query, read, load-back) overlaps prefill's compute and the increment's
    transfer, so it only delays the request once it outlasts what no decode cache waits for:
    prefill + the whole transfer, or with the transfer streamed in `groups` layer groups during
    prefill, the longer of the two plus one group."""
    kvb = costs.model.kv_bytes_per_token
    x = prefix * kvb
    prefill, transfer = costs.prefill_seconds(prompt), prompt * kvb / net_bw
    wait = max(prefill, transfer) + transfer / groups if groups else prefill + transfer
    budget = wait - 2 * l3_lat - x / host_bw
    return x / budget if budget > 0 else math.inf


def _be_items(sc: Scenario, page: int, model: str) -> tuple[list[WorkItem], list[np.ndarray]]:
    items = build_workload(sc)
    system = dict(sc.workload.params)["system_prompt"]
    prefixes = [i.sequence_keys(page, model)[: system // page] for i in items]
    return items, prefixes


def _be_run(sc: Scenario, baseline: str, warm: bool) -> dict[str, float]:
    """Requests one at a time (`sequential`), each prefix already in L3 when `warm`."""
    setup = setup_of(sc, baseline)
    page = setup.decode.page_size
    items, prefixes = _be_items(sc, page, setup.model_name)
    cluster = Cluster(setup)
    if warm:
        assert cluster.store is not None
        for keys in prefixes:
            cluster.store.add(keys.tolist())
    res = cluster.run(items, sequential=True)
    rs = [r for r in res.records if r.outcome == "finished"]
    prompt = sum(r.prompt_tokens for r in rs) or 1
    return {
        "ttft_s": mean([r.ttft_s for r in rs]),
        "promised_tokens": mean([float(r.promised_tokens) for r in rs]),
        "l3_share": sum(r.cached_l3 for r in rs) / prompt,
        "prefill_cached_share": sum(r.prefill_cached_tokens for r in rs) / prompt,
        "fallback_tokens": sum(r.fallback_tokens for r in rs),
    }


def _first_switch(points: Sequence[tuple[float, float]], threshold: float) -> float:
    """The first bandwidth whose value reaches `threshold` (NaN if none)."""
    for bw, v in points:
        if v >= threshold:
            return bw
    return math.nan


def study_break_even(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"prefix_tokens": PREFIX}
    # --- closed forms
    l70 = model_preset("llama-3-70b")
    rows = []
    closed: dict[str, Any] = {}
    for gpu_name, host_name, published in (("a800", "pcie4", 6e9), ("h800", "pcie5", 19e9)):
        gpu = gpu_preset(gpu_name)
        host = link_preset(host_name)
        moon = mooncake_break_even(8 * gpu.bf16_flops)
        ours = {}
        for eff in (1.0, 0.5):
            costs = NodeCosts(l70, attrs.evolve(gpu, efficiency=eff), 8)
            ours[eff] = {
                "compute_only": PREFIX * l70.kv_bytes_per_token / costs.prefill_seconds(PREFIX),
                "with_host_link": prefill_break_even(costs, 8 * host.bandwidth, 2e-3),
            }
        closed[gpu_name] = {"published": published, "mooncake_formula": moon, "ours": ours}
        rows.append(
            [
                f"8 x {gpu_name.upper()}",
                f"{published / 1e9:.0f}",
                f"{moon / 1e9:.2f}",
                f"{ours[1.0]['compute_only'] / 1e9:.2f}",
                f"{ours[1.0]['with_host_link'] / 1e9:.2f}",
                f"{ours[0.5]['compute_only'] / 1e9:.2f}",
                f"{ours[0.5]['with_host_link'] / 1e9:.2f}",
            ]
        )
    print_table(
        ["node", "paper", "their formula", "ours MFU 1", "+ host, 2 ms", "ours MFU .5", "+ host, 2 ms"],
        rows,
        "prefill side, GB/s: storage load of an 8K LLaMA3-70B prefix beats recomputing it above",
    )
    by_len = []
    for p in (1024, 4096, 8192, 32768, 131072):
        costs = NodeCosts(l70, attrs.evolve(gpu_preset("a800"), efficiency=1.0), 8)
        by_len.append(
            [
                p,
                f"{mooncake_break_even(8 * 312e12, p) / 1e9:.2f}",
                f"{p * l70.kv_bytes_per_token / costs.prefill_seconds(p) / 1e9:.2f}",
            ]
        )
    print_table(["prefix", "their formula", "ours (MFU 1)"], by_len, "8 x A800, GB/s, by prefix length")
    closed["by_prefix_a800"] = by_len
    # decode side: adaptive's rule, for several P->D links, on the break-even scenario's host link
    sc0 = scenario(BE_SCENARIO)
    s0 = setup_of(sc0, "l1_l2_l3")
    prompt = PREFIX + dict(sc0.workload.params)["question_tokens"][0]
    ad_rows = []
    adaptive_closed = {}
    groups = s0.decode.transfer_groups
    for per_gpu in (1e9, 2e9, 12.5e9, 25e9, 50e9):
        net = 8 * per_gpu
        b = adaptive_break_even(
            s0.costs, net, s0.host_bandwidth, s0.network_latency, s0.storage_latency, prompt, PREFIX, groups
        )
        adaptive_closed[net] = b
        ad_rows.append(
            [f"{net / 1e9:g}", f"{s0.host_bandwidth / 1e9:g}", "never" if math.isinf(b) else f"{b / 1e9:.2f}"]
        )
    print_table(
        ["P->D GB/s", "host link GB/s", "adaptive restores above (GB/s)"],
        ad_rows,
        "decode side: adaptive restores L3 when it fits within the time the whole prompt's "
        f"transfer takes to land ({f'streamed in {groups} layer groups' if groups else 'after prefill'}), "
        f"8K prefix of a {prompt}-token prompt, 8 x A800 (PCIe 4)",
    )
    cross = eager_crossing(
        s0.costs, s0.network_bandwidth, s0.host_bandwidth, s0.storage_latency, prompt, PREFIX, groups
    )
    closed["adaptive_by_network"] = adaptive_closed
    closed["scenario"] = {
        "network_bandwidth": s0.network_bandwidth,
        "adaptive_break_even": adaptive_break_even(
            s0.costs,
            s0.network_bandwidth,
            s0.host_bandwidth,
            s0.network_latency,
            s0.storage_latency,
            prompt,
            PREFIX,
            groups,
        ),
        "eager_crossing": cross,
        "prefill_seconds_prompt": s0.costs.prefill_seconds(prompt),
    }
    out["closed_form"] = closed
    adaptive = closed["scenario"]["adaptive_break_even"]
    print(
        f"\nscenario {BE_SCENARIO}: P->D {s0.network_bandwidth / 1e9:g} GB/s per node; adaptive restores "
        f"above {adaptive / 1e9:.2f} GB/s; eager beats no_decode_cache above ~{cross / 1e9:.2f} GB/s "
        f"(prefill of the {prompt}-token prompt: {s0.costs.prefill_seconds(prompt):.2f} s)"
    )
    # --- simulation
    sweep = []
    none = _be_run(scenario(BE_SCENARIO, ['run.baselines=["no_decode_cache"]']), "no_decode_cache", False)
    for gbs in BANDWIDTHS_GBS:
        bw = f"storage.bandwidth={gbs}e9"
        row: dict[str, Any] = {"bandwidth_gbs": gbs}
        for promise in ("adaptive", "eager"):
            sc = scenario(BE_SCENARIO, [bw, f'cache.promise="{promise}"'])
            row[promise] = _be_run(sc, "l1_l2_l3", True)
        for gpu in ("a800", "h800"):
            for eff in (1.0, 0.5):
                sc = scenario(
                    BE_SCENARIO,
                    [
                        bw,
                        f'hardware.gpu="{gpu}"',
                        f'hardware.host_link="{"pcie4" if gpu == "a800" else "pcie5"}"',
                        f"hardware.efficiency={eff}",
                        "cluster.prefill_cache=true",
                    ],
                )
                row[f"prefill_{gpu}_{eff}"] = _be_run(sc, "no_decode_cache", True)
        sweep.append(row)
    rows = []
    for r in sweep:
        ad, eg = r["adaptive"], r["eager"]
        best = min(eg["ttft_s"], none["ttft_s"])
        r["adaptive_over_best"] = ad["ttft_s"] / best - 1
        rows.append(
            [
                r["bandwidth_gbs"],
                f"{ad['promised_tokens']:.0f}",
                f"{ad['l3_share']:.1%}",
                f"{ad['ttft_s']:.3f}",
                f"{eg['l3_share']:.1%}",
                f"{eg['ttft_s']:.3f}",
                f"{none['ttft_s']:.3f}",
                f"{r['adaptive_over_best']:+.1%}",
                eg["fallback_tokens"],
            ]
        )
    print_table(
        [
            "L3 GB/s",
            "adapt. promised",
            "adapt. L3",
            "adapt. TTFT",
            "eager L3",
            "eager TTFT",
            "no cache TTFT",
            "adapt. vs best",
            "eager fallback tok",
        ],
        rows,
        f"decode side in simulation ({BE_SCENARIO}: 8K prefix in L3, +512 new tokens, one request at a time)",
    )
    rows = []
    for r in sweep:
        cells = [r["bandwidth_gbs"]]
        for gpu in ("a800", "h800"):
            for eff in (1.0, 0.5):
                p = r[f"prefill_{gpu}_{eff}"]
                cells.append(f"{p['prefill_cached_share']:.1%} / {p['ttft_s']:.3f}")
        rows.append(cells)
    print_table(
        ["L3 GB/s", "A800 MFU 1", "A800 MFU .5", "H800 MFU 1", "H800 MFU .5"],
        rows,
        "prefill side in simulation: share of prompt read from L3 / mean TTFT s",
    )
    ad_pts = [(r["bandwidth_gbs"], r["adaptive"]["l3_share"]) for r in sweep]
    eg_pts = [(r["bandwidth_gbs"], none["ttft_s"] - r["eager"]["ttft_s"]) for r in sweep]
    found = {
        "adaptive_switch_gbs": _first_switch(ad_pts, 0.5 * max(v for _, v in ad_pts) if ad_pts else 1.0),
        "eager_beats_none_from_gbs": _first_switch(eg_pts, 0.0),
    }
    for gpu in ("a800", "h800"):
        for eff in (1.0, 0.5):
            pts = [(r["bandwidth_gbs"], r[f"prefill_{gpu}_{eff}"]["prefill_cached_share"]) for r in sweep]
            found[f"prefill_{gpu}_{eff}_switch_gbs"] = _first_switch(pts, 0.5 * max(v for _, v in pts))
    print("\nswitch points found in simulation (first swept bandwidth past the switch):")
    for k, v in found.items():
        print(f"  {k:<32} {v:g} GB/s")
    worst = max(sweep, key=lambda r: r["adaptive_over_best"])
    print(
        f"\nadaptive's mean TTFT against the better of eager and no_decode_cache: at most "
        f"{worst['adaptive_over_best']:+.2%} (at {worst['bandwidth_gbs']} GB/s)"
    )
    out["simulation"] = {"no_decode_cache": none, "sweep": sweep, "switches": found}
    return out


# ============================================================================ command line

STUDIES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "hit-ratio": study_hit_ratio,
    "multiturn-pr": study_multiturn_pr,
    "break-even": study_break_even,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="study", required=True)
    for name in STUDIES:
        p = sub.add_parser(name)
        p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
        if name == "hit-ratio":
            p.add_argument(
                "--capacities", default="1,3,10,30,50,100", help="per-node capacities, millions of tokens"
            )
        if name == "multiturn-pr":
            p.add_argument("--no-sensitivity", action="store_true", help="only the base setting")
            p.add_argument(
                "--set",
                action="append",
                default=[],
                metavar="SECTION.KEY=VALUE",
                help="override the scenario",
            )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    doc = STUDIES[args.study](args)
    doc["wall_s"] = time.perf_counter() - t0
    print(f"\n{args.study}: {doc['wall_s']:.0f} s")
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
