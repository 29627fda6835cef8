"""TTFT of turn k of multi-turn chats on the default model, with the decode-side cache on and off:
the seed's system-level result, on a real model behind the real HTTP API.

Each run starts `hicache serve` (SmolLM2-135M-Instruct on this CPU), then plays `--conversations`
chats of `--turns` turns the way SGLang's `benchmark/hicache/bench_multiturn.py` does: each turn
posts the whole history plus a new question to `/generate` with `stream: true`, TTFT is the time
to the first line with non-empty text, and the answer joins the history. Conversations take
turns round-robin, so with a small L1 a conversation's pages have moved to L2 or L3 by the time
it comes back. Runs: `cache` (L1 + L2 + L3 on a file store) and `no_cache` (`--no-decode-cache`:
every prompt's KV comes from prefill). Prints TTFT per turn, the tier account, and the ratio.

    .venv/bin/python bench/serve_multiturn.py [--conversations 6] [--turns 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
from serve_clients import hicache_serve

SYSTEM = (
    "You are a patient travel guide. You answer questions about European cities with two or three "
    "sentences: the main sight, the best season to visit, and one dish to try. You never use lists."
)
QUESTIONS = [
    "Tell me about {city}.",
    "What is the weather like there in spring?",
    "Which museum should I not miss?",
    "How do I get there from the airport?",
    "Where should I stay for a quiet night?",
    "What is a good day trip from there?",
]
CITIES = ["Paris", "Rome", "Madrid", "Vienna", "Prague", "Lisbon", "Berlin", "Oslo", "Athens", "Dublin"]


def turn(url: str, text: str, max_new: int) -> tuple[float, str, dict[str, Any]]:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, "stream": True}
    start = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[6:])
            if ttft is None and last.get("text"):
                ttft = time.perf_counter() - start
    return ttft or float("nan"), last.get("text", ""), last.get("meta_info", {})


def play(url: str, conversations: int, turns: int, max_new: int) -> list[dict[str, Any]]:
    histories = [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n" for _ in range(conversations)]
    rows = []
    for k in range(turns):
        for c in range(conversations):
            question = QUESTIONS[k % len(QUESTIONS)].format(city=CITIES[c % len(CITIES)])
            histories[c] += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            ttft, text, meta = turn(url, histories[c], max_new)
            histories[c] += text + "<|im_end|>\n"
            tiers = meta.get("cached_tokens_details", {})
            rows.append(
                {"turn": k + 1, "conversation": c, "ttft_s": ttft, "prompt": meta.get("prompt_tokens", 0)}
            )
            rows[-1].update({t: tiers.get(t, 0) for t in ("l1", "l2", "l3")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--l1-pages", type=int, default=96, help="small, so pages spill to L2 and L3")
    ap.add_argument("--l2-pages", type=int, default=96)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results: dict[str, list[dict[str, Any]]] = {}
    runs = {
        "cache": ["--l1-pages", str(args.l1_pages), "--l2-pages", str(args.l2_pages)],
        "no_cache": ["--l1-pages", str(args.l1_pages), "--no-decode-cache"],
    }
    for name, extra in runs.items():
        with tempfile.TemporaryDirectory() as tmp:
            if name == "cache":
                extra = [*extra, "--storage-dir", str(Path(tmp) / "l3")]
            args_ = [*extra, "--log-dir", str(Path(tmp) / "logs")]
            with hicache_serve(args_, Path(tmp) / "serve.log") as ready:
                turn(ready["url"], "Hello", 2)  # warm up: the first request pays for lazy set-up
                results[name] = play(ready["url"], args.conversations, args.turns, args.max_new)
    print(
        f"{'turn':>4} {'prompt':>7} {'TTFT cache':>11} {'TTFT off':>9} {'ratio':>6}"
        f" {'L1':>6} {'L2':>6} {'L3':>6} {'hit':>6}"
    )
    for k in range(1, args.turns + 1):
        on = [r for r in results["cache"] if r["turn"] == k]
        off = [r for r in results["no_cache"] if r["turn"] == k]
        t_on = statistics.mean(r["ttft_s"] for r in on)
        t_off = statistics.mean(r["ttft_s"] for r in off)
        tiers = {t: sum(r[t] for r in on) for t in ("l1", "l2", "l3")}
        prompt = statistics.mean(r["prompt"] for r in on)
        hit = sum(tiers.values()) / max(1, sum(r["prompt"] for r in on))
        print(
            f"{k:>4} {prompt:>7.0f} {t_on:>10.3f}s {t_off:>8.3f}s {t_off / t_on:>6.2f}"
            f" {tiers['l1']:>6} {tiers['l2']:>6} {tiers['l3']:>6} {hit:>6.1%}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
