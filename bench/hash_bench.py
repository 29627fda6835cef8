"""Benchmark chained page-key functions on one token array (a script, not a test).

Usage: python bench/hash_bench.py [--tokens 1000000] [--page-size 64] [--repeat 7]

Compares our numba kernel (hicache.core.pages.page_keys) with SGLang-style chained sha256,
a per-page hashlib sha256 chain, an xxh3_64 chain (if xxhash is installed) and our pure-Python
reference, so the choice of key function rests on numbers measured on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

try:
    import hicache.core.pages  # noqa: F401  (only probing whether the package is importable)
except ImportError:  # run from a checkout without installing: put the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba  # noqa: E402

import hicache.core.pages as pages_module  # noqa: E402
from hicache.core.pages import page_keys, page_keys_reference, paginate  # noqa: E402

REFERENCE_SLICE = 20_000


def sglang_style_keys(token_list: list[int], page_size: int) -> list[str]:
    """SGLang's key semantics: sha256(prior digest bytes, then each token as 4-byte LE unsigned).

    Reimplemented from the described behaviour: one hasher per page, fed the previous page's
    hex digest decoded back to bytes (when there is one), then every token one update at a time.
    """
    keys: list[str] = []
    prior: str | None = None
    for start in range(0, len(token_list) - page_size + 1, page_size):
        hasher = hashlib.sha256()
        if prior is not None:
            hasher.update(bytes.fromhex(prior))
        for token in token_list[start : start + page_size]:
            hasher.update(token.to_bytes(4, byteorder="little", signed=False))
        prior = hasher.hexdigest()
        keys.append(prior)
    return keys


def sha256_page_chain(pages: np.ndarray) -> list[bytes]:
    """One sha256 per page over (previous digest + the page's raw bytes)."""
    keys: list[bytes] = []
    prev = b""
    for page in pages:
        prev = hashlib.sha256(prev + page.tobytes()).digest()
        keys.append(prev)
    return keys


def make_xxh3_chain() -> Callable[[np.ndarray], list[int]] | None:
    """An xxh3_64 chain seeded by the previous key, or None when xxhash is not installed."""
    try:
        import xxhash
    except ImportError:
        return None

    def xxh3_chain(pages: np.ndarray) -> list[int]:
        keys: list[int] = []
        prev = 0
        for page in pages:
            prev = xxhash.xxh3_64_intdigest(page.tobytes(), seed=prev)
            keys.append(prev)
        return keys

    return xxh3_chain


def measure(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Best and median seconds over ``repeat`` timed calls, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="number of int32 tokens")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page")
    parser.add_argument("--repeat", type=int, default=7, help="timed repeats per method")
    args = parser.parse_args(argv)
    n_tokens, page_size, repeat = args.tokens, args.page_size, args.repeat
    if n_tokens < page_size or page_size < 1 or repeat < 1:
        parser.error("need --tokens >= --page-size >= 1 and --repeat >= 1")

    print(
        f"python {platform.python_version()} ({platform.python_implementation()}), "
        f"numpy {np.__version__}, numba {numba.__version__}, os.cpu_count()={os.cpu_count()}, "
        f"{platform.machine()} {platform.system()}"
    )

    tokens = np.random.default_rng(20240601).integers(0, 128_256, n_tokens, dtype=np.int32)
    pages = paginate(tokens, page_size)
    n_pages = pages.shape[0]
    seed = 0x5EED
    print(
        f"{n_tokens:,} int32 tokens, page_size {page_size} -> {n_pages:,} full pages, "
        f"{repeat} timed repeats after 1 warm-up"
    )

    start = time.perf_counter()
    page_keys(tokens[:page_size], page_size, seed)
    first_call = time.perf_counter() - start
    stats = getattr(getattr(pages_module, "_page_keys_kernel", None), "stats", None)
    how = "numba compile or cache load"
    if stats is not None:
        how = "loaded from numba's on-disk cache" if sum(stats.cache_hits.values()) else "compiled"
    print(f"first page_keys call ({how}): {first_call * 1e3:.1f} ms")

    ref_check = tokens[: min(REFERENCE_SLICE, n_tokens)]
    if [int(k) for k in page_keys(ref_check, page_size, seed)] != page_keys_reference(
        ref_check, page_size, seed
    ):
        raise SystemExit("page_keys disagrees with page_keys_reference: not benchmarking")

    # SGLang's callers hold Python lists of token ids, so that conversion is outside the timing.
    token_list = tokens.tolist()
    ref_tokens = tokens[: min(REFERENCE_SLICE, n_tokens)]
    ref_pages = len(ref_tokens) // page_size
    ref_scale = n_pages / ref_pages if ref_pages else float("nan")

    # (label, callable, factor scaling its time to the full array)
    methods: list[tuple[str, Callable[[], object] | None, float]] = [
        ("hicache page_keys (numba)", lambda: page_keys(tokens, page_size, seed), 1.0),
        ("sglang-style sha256 (per-token update)", lambda: sglang_style_keys(token_list, page_size), 1.0),
        ("hashlib sha256 chain (per page)", lambda: sha256_page_chain(pages), 1.0),
    ]
    xxh3_chain = make_xxh3_chain()
    methods.append(
        ("xxhash xxh3_64 chain (per page)", (lambda: xxh3_chain(pages)) if xxh3_chain else None, 1.0)
    )
    methods.append(
        (
            f"pure-Python reference (x{ref_scale:.0f} from {len(ref_tokens):,} tokens)",
            lambda: page_keys_reference(ref_tokens, page_size, seed),
            ref_scale,
        )
    )

    rows: list[tuple[str, float, float] | tuple[str, None, None]] = []
    for label, fn, scale in methods:
        if fn is None:
            rows.append((label, None, None))
            continue
        best, median = measure(fn, repeat)
        rows.append((label, best * scale, median * scale))

    base_best = rows[0][1]
    assert base_best is not None
    header = f"{'method':<46} {'best ms':>10} {'median ms':>10} {'us/page':>9} {'M tok/s':>9} {'x numba':>9}"
    print()
    print(header)
    print("-" * len(header))
    for label, best, median in rows:
        if best is None or median is None:
            print(f"{label:<46} skipped: xxhash is not installed")
            continue
        print(
            f"{label:<46} {best * 1e3:>10.2f} {median * 1e3:>10.2f} {best / n_pages * 1e6:>9.3f} "
            f"{n_tokens / best / 1e6:>9.1f} {best / base_best:>9.1f}"
        )
    print("\n(us/page, M tok/s and 'x numba' use the best time; the reference row is scaled up.)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
