"""Benchmark batched page copies between two host KV pools (a script, not a test).

Usage: python bench/copy_bench.py [--batch-mib 256] [--pool-mib 1024] [--page-kib 16,256,4096]
                                  [--repeat 5] [--threads 1] [--torch-threads N]

For each page size, the `CopyEngine` copies `--batch-mib` of random distinct pages from one pool
to random distinct pages of another, in three modes: `auto` (the engine's choice by page size),
`gather` (one `index_select` into staging + one int64 `index_copy_`) and `per-run` (one `copy_`
per contiguous run, here nearly one per page). The reference is `numpy.copyto` of one contiguous
buffer of the same size in the same run: GB/s are payload bytes per second and "x memcpy" is the
ratio to it. A trio task ticking every 1 ms runs during the copies; "worst stall" is its longest
gap beyond 1 ms, i.e. how long the event loop was kept from running. The first copy of each mode
warms the staging buffer and is not counted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

try:
    import hicache.runtime  # noqa: F401  (only probing whether the package is importable)
except ImportError:
    sys.exit("bench/copy_bench.py needs the project installed: pip install -e .[runtime]")

import torch  # noqa: E402
import trio  # noqa: E402
from page_layouts import layout_for  # noqa: E402

from hicache.runtime.kv.copy_engine import LARGE_PAGE_BYTES, CopyEngine  # noqa: E402
from hicache.runtime.kv.kv_pool import KVPool  # noqa: E402


def memcpy_gbps(nbytes: int, repeat: int) -> list[float]:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # fault both buffers in
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


async def timed_copies(
    engine: CopyEngine, src: KVPool, dst: KVPool, batches: list[tuple[np.ndarray, np.ndarray]]
) -> tuple[list[float], float]:
    """GB/s of each batch after the first, and the ticker's worst stall in seconds."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await trio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last - 0.001)
            last = now

    rates = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.005)
        for i, (s, d) in enumerate(batches):
            t0 = time.perf_counter()
            await engine.copy(src, s, dst, d)
            dt = time.perf_counter() - t0
            if i:
                rates.append(s.size * src.layout.page_bytes / dt / 1e9)
        done = True
    # the check of the last batch is cheap next to the copies: compare its pages' words
    s, d = batches[-1]
    if not torch.equal(dst.words_view()[torch.from_numpy(d)], src.words_view()[torch.from_numpy(s)]):
        raise SystemExit("copy_bench: the copied pages differ from their sources")
    return rates, max(gaps, default=0.0)


async def run(args: argparse.Namespace) -> None:
    batch = args.batch_mib << 20
    pool_bytes = max(args.pool_mib << 20, batch)
    mem = memcpy_gbps(batch, args.repeat)
    ref = max(mem)
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), engine threads {args.threads}"
    )
    print(f"# batch {args.batch_mib} MiB of random distinct pages between two {pool_bytes >> 20} MiB pools")
    print(f"# memcpy (numpy.copyto, {args.batch_mib} MiB contiguous): best {ref:.2f} GB/s, "
          f"median {statistics.median(mem):.2f}")  # fmt: skip
    print()
    header = f"{'page':>8} {'mode':>8} {'best GB/s':>10} {'median':>8} {'x memcpy':>9} {'worst stall ms':>15}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for kib in args.page_kib:
        layout = layout_for(kib << 10)
        pages = pool_bytes // layout.page_bytes
        n = batch // layout.page_bytes
        src = KVPool(layout, pages, name="src")
        dst = KVPool(layout, pages, name="dst")
        words = rng.integers(-(2**63), 2**63 - 1, size=tuple(src.words_view().shape))
        src.words_view().copy_(torch.from_numpy(words))
        del words
        batches = [
            (rng.choice(pages, n, replace=False), rng.choice(pages, n, replace=False))
            for _ in range(args.repeat + 1)
        ]
        modes = {"auto": LARGE_PAGE_BYTES, "gather": 1 << 62, "per-run": 0}
        for mode, threshold in modes.items():
            engine = CopyEngine(threads=args.threads, large_page_bytes=threshold)
            rates, stall = await timed_copies(engine, src, dst, batches)
            label = f"{kib} KiB" if kib < 1024 else f"{kib >> 10} MiB"
            print(
                f"{label:>8} {mode:>8} {max(rates):>10.2f} {statistics.median(rates):>8.2f} "
                f"{max(rates) / ref:>9.2f} {stall * 1e3:>15.1f}"
            )
        del src, dst
    print()
    print(f"# auto = per-run copies from {LARGE_PAGE_BYTES >> 10} KiB per contiguous run, gather below")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-mib", type=int, default=256)
    parser.add_argument("--pool-mib", type=int, default=1024)
    parser.add_argument(
        "--page-kib",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16, 256, 4096],
        help="a list: 16,256",
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CopyEngine worker threads")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: leave)")
    args = parser.parse_args(argv)
    if args.batch_mib < 1 or args.repeat < 1:
        parser.error("--batch-mib and --repeat must be >= 1")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    trio.run(run, args)


if __name__ == "__main__":
    main()
