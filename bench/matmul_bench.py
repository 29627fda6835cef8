"""The matmuls of one decode step of the default model: weights packed once for oneDNN
(`runtime/model/packed_matrix.py`) against `x @ w` through MKL, per dtype and batch rows.

    .venv/bin/python bench/matmul_bench.py [--rows 1 8 32] [--repeat 20] [--threads 1]

The shapes are SmolLM2-135M-Instruct's (30 layers of q, k, v, o, gate, up and down, then the
vocabulary head); the weights are random, which does not change a dense kernel's time. Prints ms
per step (the median of `--repeat`) and the ratio packed / plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hicache.runtime.model.packed_matrix import PackedMatrix, packing_available

HIDDEN, KV, MLP, VOCAB, LAYERS = 576, 192, 1536, 49152, 30  # SmolLM2-135M-Instruct
LAYER_SHAPES = [
    (HIDDEN, HIDDEN),
    (HIDDEN, KV),
    (HIDDEN, KV),
    (HIDDEN, HIDDEN),
    (HIDDEN, MLP),
    (HIDDEN, MLP),
    (MLP, HIDDEN),
]


def weights(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [(HIDDEN, VOCAB)]
    return [(torch.randn(shape, generator=gen) * 0.02).to(dtype) for shape in shapes]


def step_ms(mats: list[PackedMatrix], rows: int, dtype: torch.dtype, repeat: int) -> float:
    """Median ms of one pass through every matrix with `rows` rows of input each."""
    inputs = {m.shape[0]: torch.randn(rows, m.shape[0]).to(dtype) for m in mats}
    for m in mats:  # warm-up: first calls pick and cache the kernels
        m(inputs[m.shape[0]])
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for m in mats:
            m(inputs[m.shape[0]])
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], nargs="+", default=["bfloat16", "float32"]
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeat} steps")
    print(f"{'dtype':<9} {'rows':>4} {'x @ w ms':>9} {'packed ms':>10} {'packed/plain':>13}")
    for name in args.dtype:
        dtype = getattr(torch, name)
        ws = weights(dtype)
        plain = [PackedMatrix(w, pack=False) for w in ws]
        packed = [PackedMatrix(w) for w in ws] if packing_available(dtype) else None
        for rows in args.rows:
            a = step_ms(plain, rows, dtype, args.repeat)
            if packed is None:
                print(f"{name:<9} {rows:>4} {a:>9.1f} {'(no oneDNN)':>10}")
                continue
            b = step_ms(packed, rows, dtype, args.repeat)
            print(f"{name:<9} {rows:>4} {a:>9.1f} {b:>10.1f} {b / a:>12.2f}x")


if __name__ == "__main__":
    main()
