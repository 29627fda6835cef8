"""TTFT of a long prompt and of short ones around it, through `hicache serve` on the default model:
what the prefill scheduler (chunked prefill, shortest remaining work first) changes.

One `hicache serve --model default --engine tcp` runs three scenarios, every prompt random token
ids (no prefix is shared, so every prompt is computed in full), posted to SGLang's `/generate`
with `stream: true` and `input_ids`; TTFT is the time to the first streamed line:

- `short`: `--smalls` prompts of `--small` tokens, one every `--gap` s, nothing else in flight;
- `long`: one prompt of `--long` tokens alone;
- `mixed`: the long prompt, and from `--gap` s on the short prompts, one every `--gap` s.

Prints each request's TTFT and status, p50/p99 of the short ones per scenario, and the load
average before and after. `--src DIR` runs another checkout's code (e.g. an export of the commit
before the scheduler) for the before/after comparison. `--micro` instead times, in this
process, one 512-token chunk at 6,000 tokens of context and one 200-token prompt computed as one
batched paged forward against two forwards one after the other (why the node interleaves).

    .venv/bin/python bench/prefill_sched.py [--long 7000] [--small 200] [--smalls 8] [--gap 4]
        [--src DIR] [--json OUT]
    .venv/bin/python bench/prefill_sched.py --micro
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
from other_tree import env_for

VOCAB = 49152  # SmolLM2's


def post(url: str, ids: list[int], max_new: int = 4, timeout: float = 900.0) -> dict[str, Any]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    status = 0
    error = ""
    try:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=timeout) as response:
            status = response.status_code
            if status != 200:
                error = response.read().decode(errors="replace")[:200]
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    frame = json.loads(line[6:])
                    if "error" in frame:
                        error = str(frame["error"])[:200]
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    ok = status == 200 and not error and ttft is not None
    return {
        "tokens": len(ids),
        "ttft": ttft,
        "ok": ok,
        "status": status,
        "error": error,
        "end": time.perf_counter() - start,
    }


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(100, VOCAB, n).tolist()


def scenario(
    url: str, rng: np.random.Generator, args: argparse.Namespace, long: bool, smalls: bool
) -> list[dict]:
    jobs: list[tuple[float, str, list[int]]] = []
    if long:
        jobs.append((0.0, "long", ids(rng, args.long)))
    if smalls:
        first = args.gap if long else 0.0
        jobs += [(first + i * args.gap, "short", ids(rng, args.small)) for i in range(args.smalls)]
    began = time.perf_counter()

    def run(job: tuple[float, str, list[int]]) -> dict[str, Any]:
        at, kind, prompt = job
        time.sleep(max(0.0, at - (time.perf_counter() - began)))
        return {"kind": kind, "at": at, **post(url, prompt)}

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(values, q))


def summary(rows: list[dict]) -> dict[str, Any]:
    short = [r["ttft"] for r in rows if r["kind"] == "short" and r["ok"]]
    longs = [r for r in rows if r["kind"] == "long"]
    return {
        "short_ok": f"{len(short)}/{sum(r['kind'] == 'short' for r in rows)}",
        "short_p50": pct(short, 50),
        "short_p99": pct(short, 99),
        "long_ttft": longs[0]["ttft"] if longs and longs[0]["ok"] else None,
        "long_status": (longs[0]["status"], longs[0]["error"][:120], round(longs[0]["end"], 1))
        if longs
        else None,
    }


def serve(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    env = env_for(args.src) if args.src else dict(os.environ)
    env["HICACHE_PURE"] = "1"  # the same Python core on both sides of a comparison
    cmd = [
        sys.executable,
        "-m",
        "hicache",
        "serve",
        "--model",
        "default",
        "--engine",
        "tcp",
        "--max-tokens",
        "16384",
    ]
    # cwd: not a checkout, whose hicache/ `-m` would import ahead of HICACHE_SRC's
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env, cwd=log.parent
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"hicache serve did not start: {log.read_text()[-2000:]}")
    return proc, json.loads(line)["url"]


def micro() -> None:
    import torch

    from hicache.runtime.kv.kv_pool import KVPool
    from hicache.runtime.model.loader import load_model
    from hicache.runtime.nodes import layout_for

    torch.set_num_threads(1)
    model = load_model().model
    pool = KVPool(layout_for(model.config, 16), 600, name="bench")
    rng = np.random.default_rng(0)
    long, small = ids(rng, 6512), ids(rng, 200)
    tl, ts = list(range(440)), list(range(440, 460))
    for s in range(0, 6000, 1000):
        model.forward_paged(pool.data, [tl], [s], [long[s : s + 1000]])

    def timed(fn: Any) -> float:
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began

    for _ in range(2):
        a = timed(lambda: model.forward_paged(pool.data, [tl], [6000], [long[6000:]]))
        b = timed(lambda: model.forward_paged(pool.data, [ts], [0], [small]))
        c = timed(lambda: model.forward_paged(pool.data, [tl, ts], [6000, 0], [long[6000:], small]))
        print(
            f"chunk 512 @6000: {a:.2f} s, prompt 200: {b:.2f} s, one after the other {a + b:.2f} s, "
            f"batched {c:.2f} s"
        )
    print("load average:", os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=7000)
    ap.add_argument("--small", type=int, default=200)
    ap.add_argument("--smalls", type=int, default=8)
    ap.add_argument("--gap", type=float, default=4.0)
    ap.add_argument("--src", default=None, help="run the server from this checkout instead")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--micro", action="store_true")
    args = ap.parse_args()
    if args.micro:
        micro()
        return
    rng = np.random.default_rng(7)
    out: dict[str, Any] = {"load_before": os.getloadavg(), "args": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = serve(args, Path(tmp) / "serve.log")
        try:
            post(url, ids(rng, 32))  # warm up
            for name, long, smalls in (("short", False, True), ("long", True, False), ("mixed", True, True)):
                load = os.getloadavg()
                rows = scenario(url, rng, args, long, smalls)
                out[name] = {"rows": rows, "load": load, **summary(rows)}
                s = out[name]
                print(
                    f"{name:6} load {load[0]:.1f}: short ok {s['short_ok']} p50 {s['short_p50']:.2f} s "
                    f"p99 {s['short_p99']:.2f} s; long ttft {s['long_ttft']} {s['long_status']}",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(30)
    out["load_after"] = os.getloadavg()
    print("load average before/after:", out["load_before"], out["load_after"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
