"""L3 file store throughput with eviction off and on (a script, not a test).

Usage: python bench/store_bench.py [--page-kib 64,1024] [--total-mib 256] [--batch 32]
                                   [--repeat 5] [--dir DIR] [--nixl] [--sealing]

For each page size, in a fresh directory per run: `put` of `--total-mib` of new pages in
batches of `--batch` (one `put` call per batch), then `get` of the pages the store still holds,
in the same batches. "unbounded" is `FileStore` without a capacity (no index); "bounded" has a
capacity of half the pages written, so every put past the first half evicts one page (an unlink
and index update under the index's lock) and every get hit records a use in the index. With
`--nixl`, the same two runs of `NixlFileStore` (payloads through NIXL's POSIX backend). MB/s
are payload bytes per second (10^6); files live in the page cache unless `--dir` is on a disk
that the run outgrows. Best and median of `--repeat` runs.

`--sealing` prints what sealing the pages (AES-256-GCM, `page_file.py`) costs instead: the
store as it is against the same store with a cipher that only copies (its I/O alone, the
peer), unbounded, and the cipher alone (seal and open of one page, key derivation included),
each in GB/s (10^9) of payload with the ratio of sealed to unsealed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

try:
    import hicache.runtime  # noqa: F401  (only probing whether the package is importable)
except ImportError:
    sys.exit("bench/store_bench.py needs the project installed: pip install -e .[runtime]")

import torch  # noqa: E402
import trio  # noqa: E402
from page_layouts import layout_for  # noqa: E402

from hicache.runtime.kv.kv_layout import KVLayout  # noqa: E402
from hicache.runtime.kv.kv_pool import KVPool  # noqa: E402
from hicache.runtime.storage.file_store import FileStore  # noqa: E402
from hicache.runtime.storage.page_file import (  # noqa: E402
    HEADER_SIZE,
    MAGIC,
    TAG_SIZE,
    VERSION,
    PageCipher,
)


class CopyCipher:
    """The peer of `PageCipher`: same calls, moves the bytes unsealed (the store's I/O alone)."""

    def seal(self, key, layout, payload, sealed, shard=(0, 0)) -> bytes:  # noqa: ANN001
        sealed[:-TAG_SIZE] = payload
        return (MAGIC + VERSION.to_bytes(2, "little")).ljust(HEADER_SIZE, b"\0")

    def open_into(self, header, key, layout, sealed, out, shard=(0, 0)) -> bool:  # noqa: ANN001
        out[:] = sealed[:-TAG_SIZE]
        return True


class UnsealedStore(FileStore):
    """`FileStore` whose pages are copied, not sealed: what sealing is measured against."""

    def __init__(self, *args, **kw) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kw)
        self._cipher = CopyCipher()


async def one_run(
    store_class: type[FileStore], root: Path, layout: KVLayout, pages: int, batch: int, bounded: bool
):
    capacity = (pages // 2) * (HEADER_SIZE + layout.page_bytes) if bounded else 0
    store = store_class(root, layout, secret=b"bench", capacity_bytes=capacity)
    src = KVPool(layout, batch, name="src")
    src.bytes_view().copy_(
        torch.from_numpy(
            np.random.default_rng(0).integers(0, 256, (batch, layout.page_bytes), dtype=np.uint8)
        )
    )
    dst = KVPool(layout, batch, name="dst")
    dst.bytes_view().fill_(0)
    keys = list(range(1, pages + 1))
    t0 = time.perf_counter()
    for start in range(0, pages, batch):
        chunk = keys[start : start + batch]
        await store.put(chunk, src, range(len(chunk)))
    put_s = time.perf_counter() - t0
    held = keys[pages // 2 :] if bounded else keys
    t0 = time.perf_counter()
    got = 0
    for start in range(0, len(held), batch):
        chunk = held[start : start + batch]
        got += await store.get(chunk, dst, range(len(chunk)))
    get_s = time.perf_counter() - t0
    assert got == len(held), (got, len(held))
    evicted = store.stats.evicted
    await store.aclose()
    mb = layout.page_bytes / 1e6
    return pages * mb / put_s, got * mb / get_s, evicted


def cipher_rates(layout: KVLayout, pages: int) -> tuple[float, float]:
    """GB/s of `PageCipher.seal` and `open_into` alone over `pages` pages of `layout`."""
    cipher = PageCipher(b"bench")
    payload = np.random.default_rng(0).integers(0, 256, layout.page_bytes, dtype=np.uint8)
    sealed = np.empty(layout.page_bytes + TAG_SIZE, dtype=np.uint8)
    out = np.empty(layout.page_bytes, dtype=np.uint8)
    t0 = time.perf_counter()
    headers = [cipher.seal(k, layout, payload, sealed) for k in range(pages)]
    seal_s = time.perf_counter() - t0
    header = headers[-1]
    t0 = time.perf_counter()
    for _ in range(pages):
        assert cipher.open_into(header, pages - 1, layout, sealed, out)
    open_s = time.perf_counter() - t0
    gb = pages * layout.page_bytes / 1e9
    return gb / seal_s, gb / open_s


def sealing(args: argparse.Namespace, base: Path) -> None:
    """The cost of sealing: the store sealed and unsealed side by side, and the cipher alone."""
    print("| page | what | put GB/s best (median) | get GB/s best (median) |")
    print("|---|---|---|---|")
    for kib in (int(k) for k in args.page_kib.split(",")):
        layout = layout_for(kib * 1024)
        pages = args.total_mib * 1024 // kib
        stores = (("FileStore, sealed", FileStore), ("FileStore, unsealed (peer)", UnsealedStore))
        runs: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _ in stores}
        for r in range(args.repeat):  # the two side by side, run after run: the load drifts
            for name, cls in stores:
                root = base / f"seal-{kib}-{cls.__name__}-{r}"
                put, get, _ = trio.run(one_run, cls, root, layout, pages, args.batch, False)
                shutil.rmtree(root)
                runs[name][0].append(put / 1e3)
                runs[name][1].append(get / 1e3)
        best: dict[str, tuple[float, float]] = {}
        for name, (puts, gets) in runs.items():
            best[name] = (max(puts), max(gets))
            put, get = (f"{max(v):.2f} ({statistics.median(v):.2f})" for v in (puts, gets))
            print(f"| {kib} KiB | {name} | {put} | {get} |", flush=True)
        rates = [cipher_rates(layout, pages) for _ in range(args.repeat)]
        seal, open_ = (f"{max(v):.2f} ({statistics.median(v):.2f})" for v in zip(*rates, strict=True))
        print(f"| {kib} KiB | AES-256-GCM alone: seal, open | {seal} | {open_} |")
        (sp, sg), (up, ug) = best.values()
        print(f"| {kib} KiB | ratio sealed / unsealed (best) | {sp / up:.2f} | {sg / ug:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--page-kib", default="64,1024")
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the stores go (default: a temporary folder)"
    )
    parser.add_argument("--nixl", action="store_true", help="also NixlFileStore (needs the nixl package)")
    parser.add_argument("--sealing", action="store_true", help="the cost of sealing pages (see above)")
    args = parser.parse_args()
    classes: list[tuple[str, type[FileStore]]] = [("FileStore", FileStore)]
    if args.nixl:
        from hicache.runtime.storage.nixl_store import NixlFileStore

        classes.append(("NixlFileStore", NixlFileStore))
    print(f"load average {os.getloadavg()[0]:.2f}; {args.total_mib} MiB per run, batches of {args.batch}")
    base = Path(tempfile.mkdtemp(prefix="store-bench-", dir=args.dir))
    if args.sealing:
        try:
            sealing(args, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(f"load average {os.getloadavg()[0]:.2f}")
        return
    print("| store | page | capacity | evicted | put MB/s best (median) | get MB/s best (median) |")
    print("|---|---|---|---|---|---|")
    try:
        for kib in (int(k) for k in args.page_kib.split(",")):
            layout = layout_for(kib * 1024)
            pages = args.total_mib * 1024 // kib
            for name, cls in classes:
                for bounded in (False, True):
                    puts, gets = [], []
                    for r in range(args.repeat):
                        root = base / f"{name}-{kib}-{bounded}-{r}"
                        put, get, evicted = trio.run(one_run, cls, root, layout, pages, args.batch, bounded)
                        shutil.rmtree(root)
                        puts.append(put)
                        gets.append(get)
                    cap = "half the pages" if bounded else "unbounded"
                    put, get = (f"{max(v):.0f} ({statistics.median(v):.0f})" for v in (puts, gets))
                    print(f"| {name} | {kib} KiB | {cap} | {evicted} | {put} | {get} |", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
