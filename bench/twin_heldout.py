"""The digital twin's held-out check: traffic unlike its tests, recorded on a real `hicache serve`
with the recorder's defaults, then two what-ifs predicted from that recording and measured on
the real node with the setting changed.

    .venv/bin/python bench/twin_heldout.py --out /tmp/heldout [--order A,L1,L1,A,L2,L2,A]

The traffic: `--workers` threads of the `openai` package's completions API (raw prompts, not the
chat API the tests use) take sessions from a queue; every session opens with one system prompt shared
across sessions, asks questions of mixed lengths (one word to a paragraph), and a third of them
are abandoned after one or two turns. Runs: A (the base: --l1-pages L1, --hicache-ratio 1),
L1 (--l1-pages L1_SMALL: a what-if that changes hits) and L2 (--hicache-ratio 3: a larger L2 that
the base leaves unused, which should change nothing). The twin predicts L1 and L2 from the first
A; each run's measured hit rate, per-tier tokens and TTFT are printed beside the predictions,
with the twin's intervals, as JSON in OUT/summary.json, and each what-if's real change (its runs'
mean against the A runs' mean) beside the twin's with its interval (`checks`). The default
order runs each what-if between two A runs: A B B A C C A.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SYSTEM = (
    "<|im_start|>system\nYou are the help desk of a city library. Be brief and friendly; "
    "name the floor or the desk when you can.<|im_end|>\n"
)
QUESTIONS = [
    "Hours?",
    "Where are the atlases kept, and may I take one home for a week if I leave my card at the desk?",
    "Is there a quiet room?",
    "My child wants books about volcanoes, trains and the sea; which shelves, and is there a reading "
    "corner where we can sit together on a Saturday morning?",
    "Printing cost?",
    "Can I renew online?",
]
PAGE = 16
MODEL = "SmolLM2-135M-Instruct"


def play(url: str, *, workers: int, sessions: int, turns: int, max_tokens: int) -> int:
    """The traffic; returns the requests that failed."""
    todo: queue.Queue[int] = queue.Queue()
    for s in range(sessions):
        todo.put(s)
    failed = [0]

    def worker() -> None:
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        while True:
            try:
                s = todo.get_nowait()
            except queue.Empty:
                return
            text = SYSTEM
            n = (1 + s % 2) if s % 3 == 1 else turns  # a third abandoned early
            for k in range(n):
                q = QUESTIONS[(3 * s + k) % len(QUESTIONS)]
                text += f"<|im_start|>user\n(visitor {s}) {q}<|im_end|>\n<|im_start|>assistant\n"
                try:
                    out = client.completions.create(
                        model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0, user=f"v{s}"
                    )
                except openai.OpenAIError:
                    failed[0] += 1
                    break
                text += out.choices[0].text + "<|im_end|>\n"

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failed[0]


def serve_and_record(trace: Path, l1: int, ratio: float, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "hicache", "serve", "--page-size", str(PAGE), "--l1-pages", str(l1),
        "--hicache-ratio", str(ratio), "--decode-reserve-tokens", str(PAGE),
        "--hicache-storage-backend", "none", "--record-trace", str(trace),
    ]  # fmt: skip
    log = trace.with_suffix(".log").open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        import openai  # warm-up: the first request pays the model's; its line is dropped below

        warm = openai.OpenAI(base_url=f"{ready['url']}/v1", api_key="unused", timeout=600)
        warm.completions.create(model=MODEL, prompt="hi", max_tokens=1, user="warmup")
        start = time.perf_counter()
        failed = play(ready["url"], workers=args.workers, sessions=args.sessions, turns=args.turns,
                      max_tokens=args.max_tokens)  # fmt: skip
        wall = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(60)
    _drop_warmup(trace)
    return {"wall_s": wall, "failed": failed, "load_average": os.getloadavg()}


def _drop_warmup(path: Path) -> None:
    lines = path.read_text().splitlines()
    kept = [lines[0]] + [ln for ln in lines[1:] if json.loads(ln)["input_length"] > 8]
    path.write_text("\n".join(kept) + "\n")


def measured(trace: Path) -> dict[str, Any]:
    from hicache.sim import twin

    rec = twin.read_recording(trace)
    return twin.overall(rec, None)


def compare(runs: list[dict[str, Any]], name: str, predicted: dict[str, Any]) -> dict[str, Any]:
    """The real change of a what-if (its runs' mean against the A runs' mean: points of hit rate,
    TTFT relative) beside the twin's change and interval, and whether the real one lies inside."""

    def mean(run: str, key: str) -> float:
        values = [r["measured"][key] for r in runs if r["run"] == run]
        return sum(values) / len(values)

    base, what = predicted["in_sample"], predicted["what_if"]
    out: dict[str, Any] = {}
    for key in ("hit_rate", "ttft_mean_s", "ttft_p90_s"):
        a, b = mean("A", key), mean(name, key)
        real = 100.0 * (b - a) if key == "hit_rate" else (b - a) / a
        twin_change = (
            100.0 * (what[key] - base[key]) if key == "hit_rate" else (what[key] - base[key]) / base[key]
        )
        low, high = predicted["change_intervals"].get(key) or (None, None)
        inside = low is not None and low - 1e-9 <= real <= high + 1e-9
        out[key] = {"real": real, "twin": twin_change, "interval": [low, high], "inside": inside}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--order", default="A,L1,L1,A,L2,L2,A")
    ap.add_argument("--l1", type=int, default=32)
    ap.add_argument("--l1-small", type=int, default=16)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    setting = {"A": (args.l1, 1.0), "L1": (args.l1_small, 1.0), "L2": (args.l1, 3.0)}
    runs = []
    for i, name in enumerate(args.order.split(",")):
        trace = args.out / f"{i}-{name}.jsonl"
        info = serve_and_record(trace, *setting[name], args)
        runs.append({"run": name, "trace": str(trace), **info, "measured": measured(trace)})
        print(json.dumps(runs[-1]), flush=True)

    from hicache.sim import twin

    base = next(r["trace"] for r in runs if r["run"] == "A")
    predicted = {}
    for name, over in (
        ("L1", [f"cache.l1_tokens={args.l1_small * PAGE}"]),
        ("L2", ["cache.hicache_ratio=3.0"]),
    ):
        res = twin.twin(base, over)
        print(twin.report(res), flush=True)
        predicted[name] = {
            "overrides": over,
            "in_sample": res.predicted,
            "in_sample_errors": res.errors,
            "tiers_equal": res.tiers_equal,
            "requests": len(res.recording.requests),
            "tier_difference_reasons": twin.reason_counts(list(res.tier_diffs)),
            "clients": res.clients.doc() if res.clients else None,
            "what_if": res.what_if,
            "change_intervals": res.what_if_intervals,
            "interval_replays": res.what_if_replays,
            "calibration": res.calibration.to_dict(),
        }
    checks = {
        name: compare(runs, name, predicted[name])
        for name in predicted
        if any(r["run"] == name for r in runs)
    }
    for name, check in checks.items():
        print(f"{name}: " + json.dumps(check), flush=True)
    summary = {
        "runs": runs,
        "predicted": predicted,
        "checks": checks,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
