"""AIPerf, unmodified, against `hicache serve`: a slice of Mooncake's conversation trace scaled to
the small model, replayed through the OpenAI chat endpoint with streaming, so the trace's prefix
reuse reaches the decode node's cache through the real API.

AIPerf runs from its own virtualenv (`bench/.venvs/aiperf`, created with `pip install
aiperf==0.13.0` on first use; it is not a dependency of the project). It needs a tokenizer it can
load offline: the model's, exported by `hicache serve --export-tokenizer` and laid out as a
Hugging Face cache entry (AIPerf 0.13 resolves a plain folder as a hub id inside its Mooncake
prompt workers). The slice keeps each line's `hash_ids` and its timestamps divided by
`--speedup` (AIPerf replays a mooncake_trace on its own clock), and AIPerf builds each prompt
from `--block-size` tokens per id (the trace's ids stand for 512-token blocks; 32 keeps prompts
within what the model computes quickly on a CPU).
Prints AIPerf's TTFT / ITL / request latency summary beside the front door's /metrics: requests,
prompt tokens, and cached tokens by tier.

The node records what it serves (`--record-trace`, with `--record-block-size` equal to
`--block-size`, so that a recorded id stands for as many tokens as an id of the slice AIPerf
replays), and `hicache trace stats` of the recording is printed beside the slice's: the requests,
tokens and ideal prefix reuse should match (the chat template's few tokens ahead of each prompt
shift the block boundaries by the same amount in every prompt, so shared prefixes stay shared).
`--keep DIR` keeps the slice and the recording.

`--server-metrics` lets AIPerf scrape the front door's /metrics during the run (its default,
which the plain run turns off) and prints what its server-metrics summary read: SGLang's prompt,
generation and cached token counters, the cache hit rate and the KV usage gauges.

    .venv/bin/python bench/aiperf_mooncake.py [--lines 40] [--block-size 32] [--speedup 20]
        [--server-metrics] [--src DIR]

`--src DIR` serves another checkout (e.g. `git worktree add --detach /tmp/before COMMIT`) for a
before/after pair; the client and the trace slice are the same.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx2 as httpx
from other_tree import env_for
from prometheus_client.parser import text_string_to_metric_families
from serve_clients import client_venv, hicache_serve

from hicache.scenarios.trace_stats import trace_stats
from hicache.scenarios.traces import TraceRequest, read_mooncake

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
AIPERF = "aiperf==0.13.0"
REPO = "hicache/SmolLM2-135M-Instruct"


def tokenizer_cache(home: Path) -> None:
    """The model's tokenizer as a Hugging Face cache entry for `REPO`, under `home`."""
    org, name = REPO.split("/")
    entry = home / "hub" / f"models--{org}--{name}"
    revision = hashlib.sha1(REPO.encode()).hexdigest()
    snapshot = entry / "snapshots" / revision
    subprocess.run(
        [sys.executable, "-m", "hicache", "serve", "--export-tokenizer", str(snapshot)],
        check=True,
        capture_output=True,
    )
    (entry / "refs").mkdir(parents=True, exist_ok=True)
    (entry / "refs" / "main").write_text(revision)


def trace_slice(out: Path, lines: int, block: int, max_output: int, speedup: float) -> dict[str, int]:
    """The first `lines` requests, their lengths scaled from 512-token blocks to `block`."""
    rows = []
    with TRACE.open() as f:
        for _, line in zip(range(lines), f, strict=False):
            r = json.loads(line)
            ids = r["hash_ids"]
            last = r["input_length"] - 512 * (len(ids) - 1)
            r["input_length"] = block * (len(ids) - 1) + max(1, min(block, round(last * block / 512)))
            r["output_length"] = max(1, min(max_output, r["output_length"]))
            r["timestamp"] = round(r["timestamp"] / speedup)  # AIPerf replays mooncake_trace in real time
            rows.append(r)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen: set[int] = set()
    reused = 0
    for r in rows:
        for i in r["hash_ids"]:
            reused += block if i in seen else 0
            seen.add(i)
    return {
        "requests": len(rows),
        "input_tokens": sum(r["input_length"] for r in rows),
        "ideal_reused": reused,
    }


def slice_requests(path: Path, block: int) -> list[TraceRequest]:
    """The slice as AIPerf reads it: one id per `block` tokens."""
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        ids = tuple(r["hash_ids"])
        out.append(TraceRequest(r["timestamp"] / 1000, r["input_length"], r["output_length"], ids, block))
    return out


def stats_line(name: str, requests: list[TraceRequest]) -> str:
    s = trace_stats(requests)
    ratio = s.ideal_hit_ratio
    return (
        f"{name:<10} requests {s.requests:>4}  input tokens {s.input_tokens:>7}  "
        f"blocks {s.blocks_total} total, "
        f"{s.blocks_distinct} distinct  ideal hit {'-' if ratio is None else f'{ratio:.1%}'}"
    )


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_total") or s.name.startswith("hicache_backend_"):
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{label}}}" if label else s.name] = s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--speedup", type=float, default=20.0, help="trace time / replay time")
    ap.add_argument("--artifacts", type=Path, default=ROOT / "out" / "aiperf")
    ap.add_argument("--keep", type=Path, default=None, help="copy the slice and the recording here")
    ap.add_argument("--server-metrics", action="store_true", help="let AIPerf scrape /metrics too")
    ap.add_argument("--src", type=Path, default=None, help="serve another checkout (a before figure)")
    args = ap.parse_args()
    client_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HICACHE_SRC")}
    exe = client_venv("aiperf", AIPERF, "aiperf")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer_cache(work / "hf")
        ideal = trace_slice(work / "slice.jsonl", args.lines, args.block_size, args.max_output, args.speedup)
        recorded = work / "recorded.jsonl"
        serve = ["--storage-dir", str(work / "l3"), "--record-trace", str(recorded)]
        serve += ["--record-block-size", str(args.block_size)]
        if args.src is not None:  # the server (a child) runs that tree; `-m hicache` looks in the cwd first
            os.environ.update(env_for(args.src))
            os.chdir(work)
        with hicache_serve(serve, work / "serve.log") as ready:
            url, model = ready["url"], ready["model"]
            env = {**client_env, "HF_HOME": str(work / "hf"), "HF_HUB_OFFLINE": "1"}
            cmd = [str(exe), "profile", "--model", model, "--url", url, "--endpoint-type", "chat"]
            cmd += ["--streaming", "--tokenizer", REPO, "--custom-dataset-type", "mooncake_trace"]
            cmd += ["--input-file", str(work / "slice.jsonl"), "--fixed-schedule"]
            cmd += ["--prompt-input-tokens-block-size", str(args.block_size)]
            cmd += ["--output-artifact-dir", str(args.artifacts)]
            cmd += ["--no-gpu-telemetry"] + ([] if args.server_metrics else ["--no-server-metrics"])
            print("$", " ".join(cmd), flush=True)
            load_before = os.getloadavg()[0]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            load_after = os.getloadavg()[0]
            print(done.stdout[-6000:])
            if done.returncode != 0:
                print(done.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"aiperf exited {done.returncode}")
            ours = metrics(url)
        print(stats_line("slice", slice_requests(work / "slice.jsonl", args.block_size)))
        print(stats_line("recorded", read_mooncake(recorded)))
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for name in ("slice.jsonl", "recorded.jsonl"):
                (args.keep / name).write_bytes((work / name).read_bytes())
    print(f"slice: {ideal}")
    for key in sorted(ours):
        if any(k in key for k in ("requests_total", "prompt_tokens", "cached_tokens", "generation_tokens")):
            print(f"{key:60} {ours[key]:>12.0f}")
    if args.server_metrics:
        print_server_metrics(args.artifacts / "server_metrics_export.json")
    print(summary(args.artifacts, load_before, load_after))


def summary(artifacts: Path, load_before: float, load_after: float) -> str:
    """One line from AIPerf's own exports: errors by HTTP status, TTFT p50/p99 of the requests
    that succeeded, output tokens/s, and the 1-minute load average before and after the run."""
    errors: collections.Counter[object] = collections.Counter()
    with (artifacts / "profile_export.jsonl").open() as f:
        for line in f:
            err = json.loads(line).get("error")
            if err:
                errors[err.get("code")] += 1
    agg = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    ttft = agg.get("time_to_first_token") or {}
    rate = (agg.get("output_token_throughput") or {}).get("avg")
    done = (agg.get("request_count") or {}).get("avg")
    seconds = [ttft.get(k) for k in ("p50", "p99")]
    shown = " / ".join("-" if v is None else f"{v / 1000:.2f} s" for v in seconds)
    return (
        f"summary: {done:.0f} succeeded, errors {dict(errors) or 0}, TTFT p50 / p99 {shown}, "
        f"output {rate or 0:.2f} tokens/s, load average {load_before:.2f} -> {load_after:.2f}"
    )


AIPERF_READS = (  # what AIPerf's server-metrics summary reads of an SGLang server
    "sglang:prompt_tokens",
    "sglang:generation_tokens",
    "sglang:cached_tokens",
    "sglang:cache_hit_rate",
    "sglang:token_usage",
    "sglang:hicache_host_used_tokens",
    "sglang:hicache_host_total_tokens",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:time_to_first_token_seconds",
)


def print_server_metrics(export: Path) -> None:
    """The series AIPerf collected under SGLang's names, as its export holds them."""
    if not export.exists():
        print(f"AIPerf wrote no {export.name}")
        return
    data = json.loads(export.read_text())
    found = data.get("metrics", data)
    print(f"AIPerf's server metrics ({export}):")
    for name in AIPERF_READS:
        entry = found.get(name) or found.get(name + "_total")
        if not entry:
            print(f"  {name:40} ABSENT")
            continue
        for series in entry.get("series", []):
            labels = series.get("labels") or {}
            stats = {k: v for k, v in (series.get("stats") or {}).items() if v is not None}
            shown = ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()
            )
            print(f"  {name:40} {entry.get('type', '')} {labels} {shown[:200]}")


if __name__ == "__main__":
    main()
