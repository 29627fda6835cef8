"""Processes that write pages into an L3 file store without pause until they are killed (the
victims of the crash-consistency test).

    python tests/crash_writer.py ROOT

reads commands on stdin, one per line. `go N` forks a writer process that stores pages N, N+1,
... in batches of `BATCH` and answers `ready PID` once its first batch is stored; the test kills
that process (SIGKILL) whenever it likes, and this process answers `ended PID STATUS` once it
has reaped it. Forking from one process that has imported everything already makes each writer
start at once. Page `i` is stored under `key_of(i)` and holds `page_of(key)`: its contents follow
from its key alone, so a reader knows what every page must hold without asking the writer.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import numpy as np
import trio

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.storage.file_store import FileStore

# 256 KiB pages: writing one takes long enough that a kill often lands inside it.
LAYOUT = KVLayout(layers=4, kv_heads=8, head_dim=64, page_size=16, dtype="float32")
BATCH = 16
_MIX = 0x9E3779B97F4A7C15
_BASE = (np.arange(LAYOUT.page_words, dtype=np.uint64) * np.uint64(_MIX)).view(np.uint8)
_STAMPS = np.arange(0, LAYOUT.page_words, 512)


def key_of(i: int) -> int:
    """The key of page `i`: spread over the whole key space (and so over the store's folders)."""
    return (i * _MIX + 0x632BE59BD9B4E019) % (1 << 64)


def page_of(key: int) -> np.ndarray:
    """The bytes page `key` holds (uint8): a fixed pattern with the key stamped into every 4 KiB."""
    page = _BASE.copy()
    words = page.view(np.uint64)
    words[_STAMPS] ^= np.uint64(key)
    return page


async def write_forever(root: Path, first: int) -> None:
    store = FileStore(root, LAYOUT, threads=2)
    pool = KVPool(LAYOUT, BATCH, name="writer")
    words = pool.words_view().numpy().view(np.uint64)
    words[:] = _BASE.view(np.uint64)
    stamps = _BASE.view(np.uint64)[_STAMPS]
    for batch in itertools.count():
        start = first + batch * BATCH
        keys = [key_of(i) for i in range(start, start + BATCH)]
        for j, key in enumerate(keys):
            words[j, _STAMPS] = stamps ^ np.uint64(key)  # = page_of(key), without copying a page
        await store.put(keys, pool, range(BATCH))
        if batch == 0:
            print(f"ready {os.getpid()}", flush=True)


def serve(root: Path) -> None:
    for line in sys.stdin:
        command, first = line.split()
        if command != "go":
            raise SystemExit(f"crash_writer: unknown command {line!r}")
        pid = os.fork()
        if pid == 0:  # the writer: it never returns, it is killed
            try:
                trio.run(write_forever, root, int(first))
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        print(f"ended {pid} {status}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    serve(parser.parse_args().root)


if __name__ == "__main__":
    main()
