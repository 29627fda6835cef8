"""Decode tokens/s of a decode node at --tp-size 1 and N, on the same requests, side by side.

Starts one prefill node and, in turn, a decode node of each TP size (processes on loopback, the
TCP engine), sends `--batch` requests at once (prompts of `--prompt` tokens, `--new` greedy
tokens each), and counts the tokens after the first over the window from the first request's
first token to the last request's end, so the prefill and the transfers stay out of it. Best of
`--repeat` rounds per size. On a 2-core machine the ranks share the cores with each other and
with prefill: the figure is what TP costs in collectives here, not what it gains on GPUs.

    .venv/bin/python bench/tp_decode.py --tp 1 2                   # tiny model, batch 8, 64 new
    .venv/bin/python bench/tp_decode.py --model default --tp 1 3 --new 16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

from hicache.runtime.launch import NodeProcess, start_node
from hicache.runtime.wire.client import DecodeClient


async def one_round(port: int, prompts: list[list[int]], new: int, tag: str) -> tuple[float, int, list]:
    """(seconds of the decode window, tokens decoded in it, each request's tokens)."""
    results: dict[int, tuple[float, float, list[int]]] = {}

    async def ask(i: int, prompt: list[int]) -> None:
        client = await DecodeClient.connect("127.0.0.1", port)
        sent = time.perf_counter()
        reply, _ = await client.generate(f"{tag}-{i}", prompt, new)
        assert reply["outcome"] == "finished", reply["reason"]
        results[i] = (sent + reply["ttft_s"], sent + reply["e2e_s"], reply["tokens"])
        await client.aclose()

    async with trio.open_nursery() as nursery:
        for i, p in enumerate(prompts):
            nursery.start_soon(ask, i, p)
    first = min(r[0] for r in results.values())
    last = max(r[1] for r in results.values())
    decoded = sum(len(r[2]) - 1 for r in results.values())
    return last - first, decoded, [results[i][2] for i in sorted(results)]


async def main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    model = ["--model", args.model] if args.model != "tiny" else []
    common = ["--engine", "tcp", "--page-size", "16", *model, "--threads", str(args.threads)]
    prefill = await start_node(["prefill", *common], logs, "prefill", timeout=600)
    rng = np.random.default_rng(0)
    vocab = 512 if args.model == "tiny" else 49152
    try:
        tokens_by_size = {}
        for size in args.tp:
            decode_args = ["decode", *common, "--prefill", f"127.0.0.1:{prefill.port}", "--no-storage"]
            decode_args += ["--tp-size", str(size), "--collective-timeout", "60"]
            decode: NodeProcess = await start_node(decode_args, logs, f"decode-tp{size}", timeout=600)
            try:
                best = 0.0
                for r in range(args.repeat):
                    prompts = [rng.integers(0, vocab, args.prompt).tolist() for _ in range(args.batch)]
                    if r == 0:
                        prompts = [
                            np.random.default_rng(i).integers(0, vocab, args.prompt).tolist()
                            for i in range(args.batch)
                        ]
                    secs, decoded, tokens = await one_round(decode.port, prompts, args.new, f"{size}-{r}")
                    if r == 0:
                        tokens_by_size[size] = tokens
                    best = max(best, decoded / secs)
                print(f"tp {size}: {best:.1f} decode tokens/s (batch {args.batch}, best of {args.repeat})")
            finally:
                decode.stop()
        same = [
            sum(a == b for a, b in zip(tokens_by_size[args.tp[0]], tokens_by_size[s], strict=True))
            for s in args.tp
        ]
        print(f"requests with the same tokens as tp {args.tp[0]}: {same} of {args.batch}")
    finally:
        prefill.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    trio.run(main, parser.parse_args())
