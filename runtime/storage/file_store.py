"""L3 on a file system: one file per page, shared by every node that mounts the same directory.

A page file is a fixed-size header followed by the page's raw bytes:

    offset size  field
    0      8     magic b"HICKVPG\\0"
    8      2     format version (1)
    10     2     header size (80)
    12     4     reserved (0)
    16     8     page key
    24     20    page shape, 5 x uint32 (layers, 2, page_size, kv_heads, head_dim)
    44     16    dtype name, ASCII, NUL-padded
    60     8     payload length in bytes
    68     4     CRC-32 of the payload
    72     8     reserved (0)

all little-endian. Files are written to a temporary name in the same directory and renamed over
the final name (`os.replace` is atomic on POSIX), so a reader sees a whole page or none; a
crashed writer leaves only a temporary file, removed when a store opens the directory. Every
field is checked on read and any mismatch reads as a miss. File names come from validated keys
only (16 hex digits), so no key can name a path outside the root.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import trio

from hicache.runtime.kv_layout import KVLayout
from hicache.runtime.kv_pool import KVPool, PageIndices
from hicache.runtime.storage.base import Progress, StoreStats, check_batch, key_values

MAGIC = b"HICKVPG\0"
VERSION = 1
HEADER = struct.Struct("<8sHHIQ5I16sQI8x")
HEADER_SIZE = HEADER.size
SUFFIX = ".kvpage"
_FANOUT = re.compile(r"[0-9a-f]{2}")
_TEMP = re.compile(r"\.[0-9a-f]{16}\.[0-9a-f]+\.tmp")

assert HEADER_SIZE == 80, HEADER_SIZE


def pack_header(key: int, layout: KVLayout, payload: bytes | memoryview | np.ndarray) -> bytes:
    """The header of a page file holding `payload` under `key`."""
    return HEADER.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        0,
        key,
        *layout.page_shape,
        layout.dtype.encode("ascii"),
        layout.page_bytes,
        zlib.crc32(payload),
    )


@attrs.frozen
class _Outcome:
    """What one worker-thread batch did; counters are merged on the trio thread."""

    done: int = 0
    misses: int = 0
    corrupt: int = 0
    skipped: int = 0
    cancelled: bool = False  # the calling task was cancelled: the thread stopped between pages


class FileStore:
    """Page files under `root/<first two hex digits of the key>/<key>.kvpage`.

    `fsync=True` makes a completed `put` durable across a power loss (fsync of the file and its
    directory) at the cost of a disk flush per page; without it a crash may lose recent pages but
    never exposes a partial one. `delete_corrupt=True` removes a page file that fails
    verification so the next `put` of that key rewrites it. Blocking I/O runs on worker threads
    under the store's own limiter of `threads` tokens; `get` and `put` hand batches of about
    `chunk_bytes` to a thread at a time so a cancellation takes effect between batches. A
    cancelled `get` waits for its thread, which stops at the next page boundary: the pages it
    read are reported (`progress`), and nothing writes to the pool once `get` has raised.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        layout: KVLayout,
        *,
        fsync: bool = False,
        delete_corrupt: bool = False,
        threads: int = 2,
        chunk_bytes: int = 16 << 20,
    ) -> None:
        if len(layout.dtype) > 16:
            raise ValueError(f"FileStore: dtype name {layout.dtype!r} does not fit the 16-byte header field")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"FileStore.threads: expected an int >= 1, got {threads!r}")
        self.root = Path(root)
        self.layout = layout
        self.fsync = fsync
        self.delete_corrupt = delete_corrupt
        self.stats = StoreStats()
        self._chunk_pages = max(1, chunk_bytes // layout.page_bytes)
        self._limiter = trio.CapacityLimiter(threads)
        self._closed = False
        self.root.mkdir(parents=True, exist_ok=True)
        self.leftovers_removed = self._remove_leftovers()

    # ------------------------------------------------------------------------------------ paths

    def path(self, key: object) -> Path:
        """Where the page of `key` lives (validates the key)."""
        return self._path(key_values([key])[0])

    def _path(self, key: int) -> Path:
        name = f"{key:016x}"
        return self.root / name[:2] / (name + SUFFIX)

    def _remove_leftovers(self) -> int:
        removed = 0
        for sub in self.root.iterdir():
            if not (_FANOUT.fullmatch(sub.name) and sub.is_dir()):
                continue
            for entry in sub.iterdir():
                if _TEMP.fullmatch(entry.name):
                    entry.unlink(missing_ok=True)
                    removed += 1
        return removed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"FileStore at {self.root} is closed")

    # ------------------------------------------------------------------------------------- API

    async def exists(self, keys: Sequence[object]) -> int:
        values = key_values(keys)
        self._check_open()
        if not values:
            await trio.lowlevel.checkpoint()
            return 0
        return await trio.to_thread.run_sync(self._count_present, values, limiter=self._limiter)

    async def get(
        self, keys: Sequence[object], pool: KVPool, pages: PageIndices, *, progress: Progress | None = None
    ) -> int:
        values, idx = check_batch("FileStore.get", self.layout, keys, pool, pages, into_pool=True)
        self._check_open()
        await trio.lowlevel.checkpoint()
        rows = pool.bytes_view().numpy()
        done = 0
        for start in range(0, len(values), self._chunk_pages):
            end = start + self._chunk_pages
            # Not abandoned on cancel: the thread writes into `rows`, so it is waited for.
            out = await trio.to_thread.run_sync(
                self._read_pages, values[start:end], idx[start:end], rows, limiter=self._limiter
            )
            self.stats.hits += out.done
            self.stats.misses += out.misses
            self.stats.corrupt += out.corrupt
            self.stats.bytes_read += out.done * self.layout.page_bytes
            done += out.done
            if progress is not None:
                progress(done)
            if out.cancelled:
                await trio.lowlevel.checkpoint()  # raises Cancelled; the thread has returned
            if out.done < len(values[start:end]):
                break
        return done

    async def put(self, keys: Sequence[object], pool: KVPool, pages: PageIndices) -> list[int]:
        """Every page is written or already present afterwards (a failed write raises)."""
        values, idx = check_batch("FileStore.put", self.layout, keys, pool, pages, into_pool=False)
        self._check_open()
        await trio.lowlevel.checkpoint()
        rows = pool.bytes_view().numpy()
        for start in range(0, len(values), self._chunk_pages):
            end = start + self._chunk_pages
            out = await trio.to_thread.run_sync(
                self._write_pages, values[start:end], idx[start:end], rows, limiter=self._limiter
            )
            self.stats.written += out.done
            self.stats.skipped += out.skipped
            self.stats.bytes_written += out.done * self.layout.page_bytes
        return []

    async def aclose(self) -> None:
        self._closed = True
        await trio.lowlevel.checkpoint()

    # ---------------------------------------------------------------------- worker-thread side

    def _count_present(self, keys: list[int]) -> int:
        size = HEADER_SIZE + self.layout.page_bytes
        for i, key in enumerate(keys):
            try:
                if os.stat(self._path(key)).st_size != size:
                    return i
            except FileNotFoundError:
                return i
        return len(keys)

    def _read_pages(self, keys: list[int], pages: list[int], rows: np.ndarray) -> _Outcome:
        for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
            if i and _caller_cancelled():
                return _Outcome(done=i, cancelled=True)
            status = self._read_page(key, rows[page])
            if status != "ok":
                return _Outcome(done=i, misses=int(status == "missing"), corrupt=int(status == "corrupt"))
        return _Outcome(done=len(keys))

    def _read_page(self, key: int, out: np.ndarray) -> str:
        """Read one page straight into `out`; 'ok', 'missing' or 'corrupt'."""
        path = self._path(key)
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below, on every path
        except FileNotFoundError:
            return "missing"
        with f:
            size = os.fstat(f.fileno()).st_size
            header = f.read(HEADER_SIZE) if size == HEADER_SIZE + out.nbytes else b""
            ok = len(header) == HEADER_SIZE and self._header_matches(key, header)
            ok = ok and _read_full(f, memoryview(out)) == out.nbytes
            ok = ok and zlib.crc32(out) == HEADER.unpack(header)[-1]
        if ok:
            return "ok"
        if self.delete_corrupt:
            path.unlink(missing_ok=True)
        return "corrupt"

    def _header_matches(self, key: int, header: bytes) -> bool:
        magic, version, header_size, _, stored_key, *rest = HEADER.unpack(header)
        shape, dtype, length = tuple(rest[:5]), rest[5], rest[6]
        return (
            magic == MAGIC
            and version == VERSION
            and header_size == HEADER_SIZE
            and stored_key == key
            and shape == self.layout.page_shape
            and dtype.rstrip(b"\0") == self.layout.dtype.encode("ascii")
            and length == self.layout.page_bytes
        )

    def _write_pages(self, keys: list[int], pages: list[int], rows: np.ndarray) -> _Outcome:
        written = skipped = 0
        for key, page in zip(keys, pages, strict=True):
            path = self._path(key)
            if path.exists():
                skipped += 1
                continue
            self._write_page(key, path, rows[page])
            written += 1
        return _Outcome(done=written, skipped=skipped)

    def _write_page(self, key: int, path: Path, payload: np.ndarray) -> None:
        folder = path.parent
        folder.mkdir(exist_ok=True)
        tmp = folder / f".{key:016x}.{secrets.token_hex(6)}.tmp"
        try:
            with open(tmp, "xb") as f:
                f.write(pack_header(key, self.layout, payload))
                f.write(memoryview(payload))
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _caller_cancelled() -> bool:
    """In a worker thread of `trio.to_thread.run_sync`: whether its caller was cancelled."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled:
        return True
    return False


def _read_full(f: io.FileIO, view: memoryview) -> int:
    """Fill `view` from the raw file `f`; fewer bytes only at end of file."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got
