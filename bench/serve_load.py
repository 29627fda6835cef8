"""A bounded load on `hicache serve`: concurrent streaming multi-turn chats through the `openai`
package for a fixed time, counting errors, timing TTFT, and reading the RSS of serve and its
nodes after a warm-up and at the end (the growth a leak would show).

Each client plays conversations of up to `--turns` turns (a system prompt, a question per turn,
the streamed answer joined to the history, so each turn's prompt extends the last), then starts
a new one; no client starts a request after `--seconds`, and every request started is waited
for. An error is an exception out of the client or a stream that ends without `stop` or
`length`. Prints one JSON object (and writes it to `--out`):

    .venv/bin/python bench/serve_load.py [--clients 16] [--seconds 60] [--warmup 15] [--out F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from hicache.runtime.serving.chat_traffic import CITIES, QUESTIONS, SYSTEM

MODEL = "SmolLM2-135M-Instruct"


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft: list[float] = []
        self.requests = 0
        self.errors: list[str] = []
        self.prompt_tokens: list[int] = []

    def ok(self, ttft: float) -> None:
        with self.lock:
            self.requests += 1
            self.ttft.append(ttft)

    def failed(self, why: str) -> None:
        with self.lock:
            self.requests += 1
            self.errors.append(why[:300])


def chat_turn(client: openai.OpenAI, history: list[dict[str, str]], max_tokens: int, tally: Tally) -> str:
    start = time.perf_counter()
    first: float | None = None
    text, finish = [], None
    try:
        stream = client.chat.completions.create(
            model=MODEL, messages=history, max_tokens=max_tokens, temperature=0, stream=True
        )
        for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.delta.content:
                if first is None:
                    first = time.perf_counter() - start
                text.append(choice.delta.content)
            finish = choice.finish_reason or finish
    except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
        tally.failed(f"{type(exc).__name__}: {exc}")
        return ""
    if finish not in ("stop", "length"):
        tally.failed(f"the stream ended with finish_reason {finish!r}")
        return ""
    tally.ok(first if first is not None else time.perf_counter() - start)
    return "".join(text)


def client_loop(url: str, index: int, until: float, turns: int, max_tokens: int, tally: Tally) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    conversation = 0
    while time.monotonic() < until:
        city = CITIES[(index + conversation) % len(CITIES)]
        history = [{"role": "system", "content": SYSTEM}]
        for k in range(turns):
            if time.monotonic() >= until:
                return
            history.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)].format(city=city)})
            answer = chat_turn(client, history, max_tokens, tally)
            history.append({"role": "assistant", "content": answer or "I do not know."})
        conversation += 1


@contextlib.contextmanager
def hicache_serve(args: list[str], log: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """`hicache serve ARGS` with its stderr in `log`: (its pid, its ready line)."""
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hicache", "serve", *args], stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"hicache serve did not start: {log.read_text()[-2000:]}")
        yield proc.pid, json.loads(line)
    finally:
        proc.terminate()
        proc.wait(60)


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    """Each process's resident memory (VmRSS in /proc/PID/status), in MiB; 0 for one gone."""
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            kb = 0
        out[name] = kb / 1024
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(
    clients: int, seconds: float, warmup: float, turns: int, max_tokens: int, serve_args: list[str]
) -> dict:
    with tempfile.TemporaryDirectory(prefix="hicache-load-") as tmp:
        log = Path(tmp) / "serve.log"
        with hicache_serve([*serve_args, "--log-level", "warning"], log) as (serve_pid, ready):
            url = ready["url"]
            pids = {"serve": serve_pid, **ready["pids"]}
            warm = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
            chat_turn(warm, [{"role": "user", "content": "Hello"}], 4, Tally())  # the model's first step
            tally = Tally()
            load_start = os.getloadavg()
            begin = time.monotonic()
            until = begin + seconds
            threads = [
                threading.Thread(target=client_loop, args=(url, i, until, turns, max_tokens, tally))
                for i in range(clients)
            ]
            for t in threads:
                t.start()
            time.sleep(min(warmup, seconds))
            rss_start = rss_mb(pids)
            for t in threads:
                t.join()
            elapsed = time.monotonic() - begin
            rss_end = rss_mb(pids)
            load_end = os.getloadavg()
    return {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "requests": tally.requests,
        "errors": len(tally.errors),
        "error_samples": tally.errors[:5],
        "ttft_p50_s": percentile(tally.ttft, 0.5),
        "ttft_p99_s": percentile(tally.ttft, 0.99),
        "ttft_mean_s": statistics.fmean(tally.ttft) if tally.ttft else None,
        "rss_after_warmup_mb": {k: round(v, 1) for k, v in rss_start.items()},
        "rss_end_mb": {k: round(v, 1) for k, v in rss_end.items()},
        "rss_after_warmup_total_mb": round(sum(rss_start.values()), 1),
        "rss_end_total_mb": round(sum(rss_end.values()), 1),
        "loadavg_start": load_start,
        "loadavg_end": load_end,
        "serve_args": serve_args,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the first RSS")
    parser.add_argument("--turns", type=int, default=6, help="turns of one conversation before a new one")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("serve_args", nargs="*", help="more `hicache serve` flags (after --)")
    args = parser.parse_args()
    report = run(args.clients, args.seconds, args.warmup, args.turns, args.max_tokens, args.serve_args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
