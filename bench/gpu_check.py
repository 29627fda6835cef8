"""Check the runtime's tier copies on a GPU machine (a script, not a test; under 5 minutes on one GPU).

Usage: python bench/gpu_check.py [--out results.json] [--quick] [--max-pages 1024]

On a CUDA machine it reports:
1. the device (name, memory, multiprocessors, torch and CUDA versions);
2. pinned host <-> device bandwidth of one large buffer, timed with CUDA events;
3. the CopyEngine's batched load-back L2 (pinned host pool) -> L1 (GPU pool) for 16, 64, 256 and
   1024 random distinct pages of an 8 MiB page (Llama-3-8B-like: 32 layers x K,V x 64 tokens x
   8 KV heads x 128 x bf16), a 1 MiB page (4 layers) and a 32 KiB page (1 layer, 8 tokens, which
   takes the gather/scatter path), timed end to end as a trio caller sees it, and checked
   bit-exact against a pattern that names each source page and word; plus one backup L1 -> L2;
4. how much a load-back overlaps a large bf16 matmul on the default stream: matmul alone, copy
   alone and both at once; overlap = (alone + alone - together) / min(alone, alone), 1 = fully
   hidden, 0 = serialised.
Without CUDA it says so and runs only the host parts, quickly. Results go to stdout as a table and,
with --out, as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _import_runtime_from_checkout() -> None:
    """Map runtime/ to hicache.runtime as the installed package does, for a bare checkout."""
    try:
        import hicache.runtime  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT))
        import hicache

        spec = importlib.util.spec_from_file_location(
            "hicache.runtime",
            ROOT / "runtime" / "__init__.py",
            submodule_search_locations=[str(ROOT / "runtime")],
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["hicache.runtime"] = module
        spec.loader.exec_module(module)
        hicache.runtime = module  # type: ignore[attr-defined]


_import_runtime_from_checkout()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import trio  # noqa: E402

from hicache.runtime.kv.copy_engine import CopyEngine  # noqa: E402
from hicache.runtime.kv.kv_layout import KVLayout  # noqa: E402
from hicache.runtime.kv.kv_pool import KVPool  # noqa: E402

GiB = 1 << 30
LAYOUTS = {
    "8 MiB": KVLayout(layers=32, kv_heads=8, head_dim=128, page_size=64, dtype="bfloat16"),
    "1 MiB": KVLayout(layers=4, kv_heads=8, head_dim=128, page_size=64, dtype="bfloat16"),
    "32 KiB": KVLayout(layers=1, kv_heads=8, head_dim=128, page_size=8, dtype="bfloat16"),
}


# ----------------------------------------------------------------------------------- helpers


def pattern(pages: torch.Tensor, words: int, device: torch.device) -> torch.Tensor:
    """Word w of source page p holds (p << 32) | w: every page and word is distinguishable."""
    return (pages.to(device=device, dtype=torch.int64)[:, None] << 32) | torch.arange(words, device=device)[
        None
    ]


def fill_pattern(pool: KVPool, chunk: int = 64) -> None:
    words = pool.layout.page_words
    for start in range(0, pool.num_pages, chunk):
        ids = torch.arange(start, min(start + chunk, pool.num_pages))
        pool.words_view()[start : start + ids.numel()].copy_(pattern(ids, words, pool.device))


def matches(dst: KVPool, dst_pages: np.ndarray, src_pages: np.ndarray, chunk: int = 32) -> bool:
    """Do `dst` pages hold the pattern of the source pages? (Compared where `dst` lives.)"""
    words = dst.layout.page_words
    for start in range(0, dst_pages.size, chunk):
        d = torch.from_numpy(dst_pages[start : start + chunk]).to(dst.device)
        s = torch.from_numpy(src_pages[start : start + chunk])
        if not torch.equal(dst.words_view().index_select(0, d), pattern(s, words, dst.device)):
            return False
    return True


async def timed(fn: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ------------------------------------------------------------------------------------ device


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "trio": trio.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": round(props.total_memory / GiB, 1),
            "multiprocessors": props.multi_processor_count,
            "cuda_runtime": torch.version.cuda,
        }
    return info


def link_bandwidth(nbytes: int, repeat: int) -> dict[str, float]:
    """Pinned host <-> device copies of one contiguous buffer, timed with CUDA events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(2)
    out: dict[str, float] = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        rates = []
        for _ in range(repeat + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rates.append(gbps(nbytes, start.elapsed_time(end) / 1e3))
        out[f"{name}_best_gbps"] = max(rates[1:])
        out[f"{name}_median_gbps"] = statistics.median(rates[1:])
    return out


async def load_back(
    engine: CopyEngine, label: str, host: KVPool, dev: KVPool, counts: list[int], repeat: int
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(len(label))
    rows = []
    for n in counts:
        n = min(n, host.num_pages, dev.num_pages)
        src = rng.choice(host.num_pages, n, replace=False)
        dst = rng.choice(dev.num_pages, n, replace=False)
        await engine.copy(host, src, dev, dst)  # warm: staging, streams, first touch
        walls = [await timed(partial(engine.copy, host, src, dev, dst)) for _ in range(repeat)]
        dev.words_view().zero_()
        if dev.is_cuda:  # a device pool in host memory (a CPU run) has nothing to wait for
            torch.cuda.synchronize()
        await engine.copy(host, src, dev, dst)
        exact = matches(dev, dst, src)  # read on the default stream right after the copy returned
        nbytes = n * host.layout.page_bytes
        rows.append(
            {
                "page": label,
                "pages": n,
                "mib": nbytes >> 20,
                "best_gbps": gbps(nbytes, min(walls)),
                "median_gbps": gbps(nbytes, statistics.median(walls)),
                "best_ms": min(walls) * 1e3,
                "bit_exact": exact,
            }
        )
    return rows


async def backup(
    engine: CopyEngine, label: str, dev: KVPool, host: KVPool, n: int, repeat: int
) -> dict[str, Any]:
    """L1 -> L2 of `n` pages, checked on the host."""
    fill_pattern(dev)
    torch.cuda.synchronize()
    rng = np.random.default_rng(99)
    n = min(n, host.num_pages, dev.num_pages)
    src = rng.choice(dev.num_pages, n, replace=False)
    dst = rng.choice(host.num_pages, n, replace=False)
    await engine.copy(dev, src, host, dst)
    walls = [await timed(partial(engine.copy, dev, src, host, dst)) for _ in range(repeat)]
    host.words_view()[torch.from_numpy(dst)] = 0
    await engine.copy(dev, src, host, dst)
    nbytes = n * dev.layout.page_bytes
    return {
        "page": label,
        "pages": n,
        "mib": nbytes >> 20,
        "best_gbps": gbps(nbytes, min(walls)),
        "median_gbps": gbps(nbytes, statistics.median(walls)),
        "bit_exact": matches(host, dst, src),
    }


async def overlap(engine: CopyEngine, host: KVPool, dev: KVPool, n: int, repeat: int) -> dict[str, Any]:
    """A load-back on the engine's side stream against bf16 matmuls on the default stream."""
    rng = np.random.default_rng(5)
    n = min(n, host.num_pages, dev.num_pages)
    src = rng.choice(host.num_pages, n, replace=False)
    dst = rng.choice(dev.num_pages, n, replace=False)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def matmuls(k: int) -> None:
        for _ in range(k):
            torch.matmul(a, b, out=c)

    matmuls(3)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    matmuls(10)
    torch.cuda.synchronize()
    per_matmul = (time.perf_counter() - t0) / 10
    await engine.copy(host, src, dev, dst)
    copy_alone = min([await timed(partial(engine.copy, host, src, dev, dst)) for _ in range(repeat)])
    k = max(1, round(copy_alone / per_matmul))

    async def matmul_alone() -> None:
        matmuls(k)
        torch.cuda.synchronize()

    async def both() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.copy, host, src, dev, dst)  # returns once enqueued
            matmuls(k)
        torch.cuda.synchronize()

    mm_alone = min([await timed(matmul_alone) for _ in range(repeat)])
    together = statistics.median([await timed(both) for _ in range(repeat)])
    hidden = (mm_alone + copy_alone - together) / min(mm_alone, copy_alone)
    flops = 2 * 8192**3 * k
    return {
        "pages": n,
        "mib": n * host.layout.page_bytes >> 20,
        "matmuls": k,
        "matmul_ms": mm_alone * 1e3,
        "matmul_tflops": flops / mm_alone / 1e12,
        "copy_ms": copy_alone * 1e3,
        "copy_gbps": gbps(n * host.layout.page_bytes, copy_alone),
        "together_ms": together * 1e3,
        "overlap": hidden,
        "bit_exact": matches(dev, dst, src),
    }


# -------------------------------------------------------------------------------------- host


async def host_parts(quick: bool) -> dict[str, Any]:
    """Host memcpy and the engine's host-to-host path (what a CPU-only node runs)."""
    nbytes = (64 if quick else 512) << 20
    a, b = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    np.copyto(b, a)
    t0 = time.perf_counter()
    np.copyto(b, a)
    memcpy = gbps(nbytes, time.perf_counter() - t0)
    del a, b
    layout = LAYOUTS["1 MiB"]
    pages = 96 if quick else 640
    src, dst = KVPool(layout, pages, name="src"), KVPool(layout, pages, name="dst")
    fill_pattern(src)
    engine = CopyEngine(threads=2)
    rng = np.random.default_rng(3)
    rows = []
    for n in (16, 64) if quick else (16, 64, 256, 512):
        s, d = rng.choice(pages, n, replace=False), rng.choice(pages, n, replace=False)
        await engine.copy(src, s, dst, d)
        wall = min([await timed(partial(engine.copy, src, s, dst, d)) for _ in range(3)])
        rows.append(
            {
                "page": "1 MiB",
                "pages": n,
                "mib": n,
                "best_gbps": gbps(n << 20, wall),
                "bit_exact": matches(dst, d, s),
            }
        )
    return {"memcpy_gbps": memcpy, "host_copy": rows}


# -------------------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"device": device_info()}
    if not torch.cuda.is_available():
        print("no CUDA device: torch sees no GPU, running the host parts only")
        results["host"] = await host_parts(quick=True)
        return results
    results["host"] = await host_parts(quick=args.quick)
    repeat = 3
    results["link"] = link_bandwidth((256 << 20) if args.quick else 2 * GiB, repeat)
    engine = CopyEngine(threads=2)
    counts = [c for c in (16, 64, 256, 1024) if c <= args.max_pages]
    results["load_back"], results["backup"] = [], []
    for label, layout in LAYOUTS.items():
        pages = max(counts)
        host = KVPool(layout, pages, name="l2")
        dev = KVPool(layout, pages, device="cuda", name="l1")
        fill_pattern(dev)
        host.words_view().copy_(dev.words_view())
        dev.words_view().zero_()
        torch.cuda.synchronize()
        results["load_back"] += await load_back(engine, label, host, dev, counts, repeat)
        if label == "8 MiB":
            results["overlap"] = await overlap(engine, host, dev, min(256, pages), repeat)
        results["backup"].append(await backup(engine, label, dev, host, min(256, pages), repeat))
        del host, dev
        torch.cuda.empty_cache()
    results["engine"] = {"batches": engine.stats.batches, "staging_allocs": engine.stats.staging_allocs}
    return results


def print_table(results: dict[str, Any]) -> None:
    dev = results["device"]
    print(" ".join(f"{k}={v}" for k, v in dev.items()))
    host = results["host"]
    print(f"host memcpy: {host['memcpy_gbps']:.2f} GB/s")
    sections = [("host copy", host["host_copy"])]
    if "link" in results:
        link = results["link"]
        print(
            f"pinned H2D {link['h2d_best_gbps']:.1f} GB/s (median {link['h2d_median_gbps']:.1f}), "
            f"D2H {link['d2h_best_gbps']:.1f} GB/s (median {link['d2h_median_gbps']:.1f})"
        )
        sections += [("load-back L2->L1", results["load_back"]), ("backup L1->L2", results["backup"])]
    for title, rows in sections:
        print(f"\n{title}:")
        print(f"{'page':>8} {'pages':>6} {'MiB':>6} {'best GB/s':>10} {'median':>8} {'bit-exact':>10}")
        for r in rows:
            median = f"{r['median_gbps']:.1f}" if "median_gbps" in r else "-"
            print(
                f"{r['page']:>8} {r['pages']:>6} {r['mib']:>6} {r['best_gbps']:>10.1f} {median:>8} "
                f"{r['bit_exact']!s:>10}"
            )
    if "overlap" in results:
        o = results["overlap"]
        print(
            f"\noverlap: {o['pages']} pages ({o['mib']} MiB) load-back {o['copy_ms']:.1f} ms alone "
            f"({o['copy_gbps']:.1f} GB/s), {o['matmuls']} bf16 8192^3 matmuls {o['matmul_ms']:.1f} ms alone "
            f"({o['matmul_tflops']:.0f} TFLOP/s), together {o['together_ms']:.1f} ms "
            f"-> overlap {o['overlap']:.2f} (bit-exact {o['bit_exact']})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="smaller buffers and batches")
    parser.add_argument("--max-pages", type=int, default=1024, help="largest load-back batch")
    args = parser.parse_args(argv)
    if args.max_pages < 16:
        parser.error("--max-pages must be >= 16")
    t0 = time.perf_counter()
    results = trio.run(run, args)
    results["wall_s"] = time.perf_counter() - t0
    print_table(results)
    print(f"\nwall {results['wall_s']:.1f} s")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    checks = [r["bit_exact"] for key in ("load_back", "backup") for r in results.get(key, [])]
    checks += [r["bit_exact"] for r in results["host"]["host_copy"]]
    checks += [results["overlap"]["bit_exact"]] if "overlap" in results else []
    if not all(checks):
        print("FAILED: some copies were not bit-exact")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
