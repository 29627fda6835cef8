"""Serving speed and memory of `hicache serve` against llama.cpp's `llama-server`, one client.

Each server is started in turn, driven by the same client over its OpenAI endpoint
(`/v1/completions`, streamed, temperature 0, `ignore_eos`, prompts given as token ids, so no
tokenizer differs), and stopped; the servers alternate A B B A (`--rounds 2`). Per server:

- output tokens/s at concurrency 1, 8 and 32: that many streams at once, each request a fresh
  random prompt of `--prompt` tokens and `--new` output tokens; tokens/s is every stream's output
  tokens over the wall time from the first request sent to the last token received;
- TTFT of one cold prompt of 512 and of 2,000 tokens (fresh random ids: no cache hit anywhere);
- multi-turn TTFT with each server's own prefix cache: `--conversations` chats of `--turns` turns,
  visited round-robin by one client; turn k's prompt is turn k-1's prompt followed by
  `--turn-tokens` fresh ids (the part a chat client would add: the reply and the next question),
  so every turn after the first can reuse its whole previous prompt. `mt_first` is the mean TTFT
  of the first turns (cold), `mt_later` that of every later turn (what the cache saves);
- peak RSS and peak PSS of the server's whole process tree (hicache: front door, prefill and
  decode nodes), sampled every 0.2 s from start-up to shutdown. Summed RSS counts the libraries
  the three processes share (python, torch) three times; summed PSS counts them once.

    .venv/bin/python bench/serve_vs_llamacpp.py \\
        --server hicache=SRC --server llama-q4=/work/llama-build/build/bin/llama-server:Q4_1.gguf ...

`transformers=DTYPE` is not a server: bench/transformers_peer.py measures the same figures on
`generate` in a process of its own (one thread), whose memory is sampled the same way.

A `hicache=SRC` server runs `python -m hicache serve` from the checkout at SRC (so main as found and
this branch alternate in one run), with the serve flags after a `;` if any
(`hicache-wt=.;--hicache-write-policy write_through`); `llama-NAME=BIN:GGUF` runs `BIN -m GGUF -t 1
-c 16384 -np 32 -kvu` (its default `-t 2` collapses on a shared 2-core machine). The load average is printed
before and after each server's run, since the machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from other_tree import env_for

VOCAB_LOW, VOCAB_HIGH = 100, 49000  # ordinary tokens of the default model's vocabulary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RssSampler(threading.Thread):
    """The peaks of the summed RSS and the summed PSS of `pid` and all its descendants.

    RSS counts a page shared by several processes (torch's and python's libraries, mapped by
    each of hicache's three) once per process; PSS splits it among them, so the summed PSS is
    what the tree takes from the machine. A single process (llama-server) has PSS ~= RSS."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak = 0
        self.peak_pss = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            rss = pss = 0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            for p in procs:
                with contextlib.suppress(psutil.Error):  # a process that just ended
                    mem = p.memory_full_info()
                    rss += mem.rss
                    pss += mem.pss
            self.peak = max(self.peak, rss)
            self.peak_pss = max(self.peak_pss, pss)
            self.stop.wait(0.2)

    def finish(self) -> dict[str, float]:
        """Stop sampling; the peaks in GiB, as the figures name them."""
        self.stop.set()
        self.join()
        return {"peak_rss_gib": self.peak / 2**30, "peak_pss_gib": self.peak_pss / 2**30}


def start_server(spec: str, log: Path, dtype: str) -> tuple[subprocess.Popen, int]:
    """Start the server `spec` names; its process and port once it answers."""
    name, _, where = spec.partition("=")
    port = free_port()
    if name.startswith("hicache"):
        where, _, flags = where.partition(";")
        env = env_for(where)
        cmd = [sys.executable, "-m", "hicache", "serve", "--port", str(port), "--log-level", "warning"]
        if dtype:
            cmd += ["--dtype", dtype]
        cmd += shlex.split(flags)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env, cwd=where
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"{spec}: did not start: {log.read_text()[-2000:]}")
        return proc, port
    binary, _, model = where.partition(":")
    cmd = [
        binary,
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "16384",
        "-np",
        "32",
        "-kvu",
        "-t",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{spec}: not healthy after 300 s: {log.read_text()[-2000:]}")


def stream(port: int, prompt: list[int], new: int) -> tuple[float, float, int]:
    """One streamed completion: (seconds to the first token, seconds in all, output tokens)."""
    body = {
        "prompt": prompt,
        "max_tokens": new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    first, chunks, usage = -1.0, 0, None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        doc = json.loads(data)
        if doc.get("usage"):
            usage = doc["usage"].get("completion_tokens")
        for choice in doc.get("choices") or []:
            if choice.get("text"):
                chunks += 1
                if first < 0:
                    first = time.perf_counter() - start
    conn.close()
    return first, time.perf_counter() - start, int(usage if usage is not None else chunks)


def throughput(port: int, concurrency: int, prompt_len: int, new: int, rng: random.Random) -> float:
    """Output tokens/s of `concurrency` streams at once, one request each."""
    prompts = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(prompt_len)] for _ in range(concurrency)]
    tokens = [0] * concurrency
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            tokens[i] = stream(port, prompts[i], new)[2]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(tokens) / (time.perf_counter() - start)


def multiturn(port: int, args: argparse.Namespace, rng: random.Random) -> tuple[float, float]:
    """Mean TTFT of the first turns and of the later ones, conversations visited round-robin."""
    chats: list[list[int]] = [[] for _ in range(args.conversations)]
    first: list[float] = []
    later: list[float] = []
    for turn in range(args.turns):
        for chat in chats:
            chat += [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.turn_tokens)]
            (later if turn else first).append(stream(port, chat, args.turn_new)[0])
    return sum(first) / len(first), sum(later) / max(1, len(later))


def measure_transformers(spec: str, args: argparse.Namespace, log: Path, seed: int) -> dict[str, Any]:
    """`transformers=DTYPE`: bench/transformers_peer.py in a process of its own, its memory
    sampled from here as a server's is."""
    out: dict[str, Any] = {"server": spec.partition("=")[0], "load_before": os.getloadavg()[0]}
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("transformers_peer.py")),
        "--dtype",
        spec.partition("=")[2],
    ]
    cmd += ["--threads", "1", "--seed", str(seed), "--prompt", str(args.prompt), "--new", str(args.new)]
    cmd += ["--concurrency", *map(str, args.concurrency), "--ttft", *map(str, args.ttft)]
    cmd += ["--turns", str(args.turns), "--conversations", str(args.conversations)]
    cmd += ["--turn-tokens", str(args.turn_tokens)]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        sampler = RssSampler(proc.pid)
        sampler.start()
        stdout, _ = proc.communicate()
        out.update(sampler.finish())
    if proc.returncode != 0:
        raise SystemExit(f"{spec}: failed: {log.read_text()[-2000:]}")
    out.update(json.loads(stdout.strip().splitlines()[-1]))
    out["load_after"] = os.getloadavg()[0]
    print("  " + log.read_text().strip().replace("\n", "\n  "), flush=True)
    return out


def measure(spec: str, args: argparse.Namespace, log: Path, seed: int) -> dict[str, Any]:
    if spec.startswith("transformers"):
        return measure_transformers(spec, args, log, seed)
    rng = random.Random(seed)
    load_before = os.getloadavg()[0]
    proc, port = start_server(spec, log, args.dtype)
    sampler = RssSampler(proc.pid)
    sampler.start()
    out: dict[str, Any] = {"server": spec.partition("=")[0], "load_before": load_before}
    try:
        stream(port, [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(16)], 4)  # warm up
        for c in args.concurrency:
            out[f"tok_s_c{c}"] = throughput(port, c, args.prompt, args.new, rng)
            print(f"  {out['server']} c={c}: {out[f'tok_s_c{c}']:.2f} tok/s", flush=True)
        for n in args.ttft:
            prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]
            out[f"ttft_{n}"] = stream(port, prompt, 1)[0]
            print(f"  {out['server']} ttft {n}: {out[f'ttft_{n}']:.3f} s", flush=True)
        if args.turns > 0:
            out["mt_first"], out["mt_later"] = multiturn(port, args, rng)
            mt = f"first {out['mt_first']:.3f} s, later {out['mt_later']:.3f} s"
            print(f"  {out['server']} multi-turn TTFT: {mt}", flush=True)
    finally:
        out.update(sampler.finish())
        out["load_after"] = os.getloadavg()[0]
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--server",
        action="append",
        required=True,
        help="NAME=SRC[;SERVE FLAGS] (hicache), llama-NAME=BIN:GGUF, or transformers=float32|bfloat16",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ttft", type=int, nargs="*", default=[512, 2000])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens of each throughput request")
    parser.add_argument("--new", type=int, default=32, help="output tokens of each throughput request")
    parser.add_argument("--turns", type=int, default=4, help="turns of each multi-turn chat (0: none)")
    parser.add_argument("--conversations", type=int, default=4, help="multi-turn chats, round-robin")
    parser.add_argument("--turn-tokens", type=int, default=256, help="prompt tokens each turn adds")
    parser.add_argument("--turn-new", type=int, default=8, help="output tokens of each turn")
    parser.add_argument(
        "--rounds", type=int, default=2, help="A B .. then .. B A: each server this many times"
    )
    parser.add_argument("--dtype", default="", help="hicache's --dtype (default: its own default)")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/serve_vs_llamacpp"))
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    order: list[str] = []
    for r in range(args.rounds):
        order += args.server if r % 2 == 0 else list(reversed(args.server))
    runs = []
    for i, spec in enumerate(order):
        print(f"[{i + 1}/{len(order)}] {spec} (load {os.getloadavg()[0]:.2f})", flush=True)
        runs.append(measure(spec, args, args.logs / f"{i}-{spec.partition('=')[0]}.log", seed=i))
        print("  " + json.dumps(runs[-1]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))
    keys = [f"tok_s_c{c}" for c in args.concurrency] + [f"ttft_{n}" for n in args.ttft]
    keys += (["mt_first", "mt_later"] if args.turns > 0 else []) + ["peak_rss_gib", "peak_pss_gib"]
    print("\nbest of each server's runs (tok/s: highest; TTFT and memory: lowest):")
    print("| server | " + " | ".join(keys) + " | load |")
    for name in dict.fromkeys(r["server"] for r in runs):
        mine = [r for r in runs if r["server"] == name]
        best = [max(r[k] for r in mine) if k.startswith("tok") else min(r[k] for r in mine) for k in keys]
        load = ", ".join(f"{r['load_before']:.1f}" for r in mine)
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in best) + f" | {load} |")


if __name__ == "__main__":
    main()
