"""Time of one batched decode step (`LlamaModel.decode_batch`), the decode node's per-step call.

The batch is laid out as the decode node lays it out: every request's page table holds its
context's pages, a scratch page last; each step moves every request one position on. The model
is seeded (`TinyModel`), so nothing is loaded: `--shape tiny` is the tests' model (where the
Python around the forward weighs most), `--shape smol` has SmolLM2-135M's shape (30 layers, 9
query heads, 3 KV heads of 64, a 1536-wide MLP, 49152 tokens) in float32.

    .venv/bin/python bench/paged_step_bench.py --shape tiny --batch 8 --context 512 --steps 200
    .venv/bin/python bench/paged_step_bench.py --shape smol --batch 8 --context 512 --steps 50

Prints the median and best step time over `--repeat` runs of `--steps` steps (one thread: the
machine is shared, and a second OpenMP thread whose core is busy stalls every op).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hicache.runtime.model.llama import TinyConfig, TinyModel

SHAPES = {
    "tiny": {},
    "smol": {
        "layers": 30,
        "q_heads": 9,
        "kv_heads": 3,
        "head_dim": 64,
        "ffn": 1536,
        "vocab": 49152,
        "dtype": "float32",
    },
}


def run(model: TinyModel, batch: int, context: int, steps: int, page_size: int) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` requests starting at `context` tokens."""
    cfg = model.config
    pages_each = -(-(context + steps) // page_size) + 1  # + a scratch page, as the node has
    pool = torch.zeros(
        (batch * pages_each, cfg.layers, 2, page_size, cfg.kv_heads, cfg.head_dim), dtype=cfg.torch_dtype
    )
    tables = [list(range(b * pages_each, (b + 1) * pages_each)) for b in range(batch)]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (batch,), generator=gen).tolist()
    times = []
    for step in range(steps):
        positions = [context + step] * batch
        start = time.perf_counter()
        logits = model.decode_batch(pool, tables, positions, tokens)
        times.append(time.perf_counter() - start)
        tokens = logits.argmax(dim=-1).tolist()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = TinyModel(TinyConfig(**SHAPES[args.shape]))
    run(model, args.batch, args.context, 5, args.page_size)  # warm up
    per_run = []
    for _ in range(args.repeat):
        times = run(model, args.batch, args.context, args.steps, args.page_size)
        per_run.append(statistics.median(times))
    print(
        f"shape={args.shape} batch={args.batch} context={args.context} page={args.page_size} "
        f"steps={args.steps}: median step {statistics.median(per_run) * 1e6:,.0f} us "
        f"(best run {min(per_run) * 1e6:,.0f} us)"
    )


if __name__ == "__main__":
    main()
