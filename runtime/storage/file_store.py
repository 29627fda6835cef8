"""L3 on a file system: one file per page, shared by every node that mounts the same directory.

A page file (`page_file.py`) is a fixed-size header, then the page's bytes sealed with
AES-256-GCM under a key derived from a cluster secret (`FileStore(secret=...)`, else the
environment variable HICACHE_CLUSTER_SECRET, else a random secret the first store writes to
`ROOT/.hicache-secret` with mode 0600) and the page key: a page nobody with the secret wrote
reads as a miss, and nobody without it can read a page's KV (which gives the prompt back).
Page files are created 0600 and the folders this store makes 0700, so other users of the host
cannot even read the ciphertext; a root or sub-folder that others may enter is logged once.

Files are written to a temporary name in the same directory and renamed over the final name
(`os.replace` is atomic on POSIX), so a reader sees a whole page or none. A store opening the
directory removes the temporaries of writers on this host that are gone (`file_recovery.py`).
Nothing outside the root is read or written: file names come from validated keys only,
sub-folders and page files are opened with O_NOFOLLOW (`file_io.py`: a symlink there is an
error, never followed, also by the start-up clean-up).

A store given a capacity keeps the directory's page files within it, together with every other
bounded store on the directory: an index next to the pages (`.hicache-index.sqlite`, see
`page_index.py` for the segmented-LRU policy and why) counts their bytes and orders them for
eviction; one write transaction unlinks the victims, renames the new page into place and records
it, so the files on disk never exceed the capacity by more than the temporaries being written.
A reader that opened a page before it was evicted reads the whole file; after, it misses.
A tensor-parallel rank's store keeps its pages under `ROOT/tp<N>/rank<r>/` with the shard in the
header (authenticated with the page), so one rank's page never reads as another's.

No input from the disk stops a node: every OS error of `exists`, `get` or `put` is a miss or a
page reported not written (`stats.errors` counts them), logged once per kind (read or write,
errno) with its reason on the `hicache.runtime.storage` logger; an error while opening the store
leaves a store that misses and writes nothing where the disk refuses.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import logging
import os
import secrets
import sqlite3
import stat
import threading
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import trio

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool, PageIndices
from hicache.runtime.security.cluster_secret import (
    SECRET_ENV,
    UntrustedSecret,
    ensure_secret_file,
    env_secret,
)
from hicache.runtime.storage.base import Progress, StoreStats, check_batch, key_values
from hicache.runtime.storage.file_io import (
    CREATE_FLAGS,
    FS_WIDE,
    READ_FLAGS,
    describe,
    open_dir,
    read_full,
    regular,
    write_all,
)
from hicache.runtime.storage.file_recovery import (
    KEY_NAME,
    index_error,
    open_index,
    remove_leftovers,
    remove_page,
    temp_name,
)
from hicache.runtime.storage.page_file import HEADER_SIZE, SUFFIX, TAG_SIZE, VERSION, PageCipher, page_version
from hicache.runtime.storage.page_index import INDEX_FILE, NoRoom, PageIndex

logger = logging.getLogger("hicache.runtime.storage")

KEY_FILE = ".hicache-secret"
DIR_MODE = 0o700  # folders this store makes: only the node's user may list or enter them
FILE_MODE = 0o600  # page files: only the node's user may read them


@attrs.frozen
class _Outcome:
    """What one worker-thread batch did; counters are merged and errors logged on the trio thread."""

    done: int = 0
    misses: int = 0
    corrupt: int = 0
    skipped: int = 0
    failed: tuple[int, ...] = ()  # put: positions in the batch not written
    errors: tuple[OSError, ...] = ()  # one per page an OS error stopped
    cancelled: bool = False  # the calling task was cancelled: the thread stopped between pages
    evicted: int = 0  # pages this batch's writes evicted
    refused: int = 0  # put: pages larger than the capacity, or no room (in `failed`, not errors)
    index_errors: tuple[OSError, ...] = ()  # uses the index could not record


class FileStore:
    """Page files under `root/<first two hex digits of the key>/<key>.kvpage`.

    `secret` (bytes or str) keys the pages' encryption (`secret_source` names where it came from,
    for the log; nodes pass their cluster secret); without it the store uses
    HICACHE_CLUSTER_SECRET, else `root/.hicache-secret` (see the module docstring), and
    `secret_source` says which. Stores share pages only if they share the secret.
    `fsync=True` makes a completed `put` durable across a power loss (fsync of the file and its
    directory) at the cost of a disk flush per page; without it a crash may lose recent pages but
    never exposes a partial one.
    `delete_corrupt=True` removes a page file that fails verification so the next `put` of that
    key rewrites it. Blocking I/O runs on worker threads under the store's own limiter of
    `threads` tokens; `get` and `put` hand batches of about `chunk_bytes` to a thread at a time so
    a cancellation takes effect between batches. A cancelled `get` waits for its thread, which
    stops at the next page boundary: the pages it read are reported (`progress`), and nothing
    writes to the pool once `get` has raised.

    `capacity_bytes` bounds the page files of the store's directory, headers included, shared
    with every bounded store on that directory through its index (`page_index.py`: segmented
    LRU, the policy and why); `protected_fraction` of it at most holds pages that were used
    again. None joins the capacity a bounded store recorded in the directory's index (so a
    reader such as a prefill node counts its uses too), and is unbounded where there is none; 0
    is unbounded, as before, and keeps no index. A `get` hit and an `exists` hit are uses; a
    `put` of a page already there is not. Evicting (unlinking victims, under the index's lock)
    runs in the same worker threads as the writes. `rank` and `tp_size` open one tensor-parallel rank's
    shard, `root/tp<tp_size>/rank<rank>/`, whose page headers name the shard (authenticated), so
    a rank never reads another's page; `tp_size=1` is the unsharded layout directly under `root`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        layout: KVLayout,
        *,
        secret: bytes | str | None = None,
        secret_source: str = "argument",
        fsync: bool = False,
        delete_corrupt: bool = False,
        threads: int = 2,
        chunk_bytes: int = 16 << 20,
        capacity_bytes: int | None = None,
        protected_fraction: float = 0.8,
        rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        if len(layout.dtype) > 16:
            raise ValueError(f"FileStore: dtype name {layout.dtype!r} does not fit the 16-byte header field")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"FileStore.threads: expected an int >= 1, got {threads!r}")
        if secret is not None and not isinstance(secret, bytes | str):
            raise ValueError(f"FileStore.secret: expected bytes or str, got {type(secret).__name__}")
        if secret is not None and not secret:
            raise ValueError("FileStore.secret: an empty secret authenticates nothing")
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0
        ):
            raise ValueError(
                f"FileStore.capacity_bytes: expected an int >= 0 or None, got {capacity_bytes!r}"
            )
        for name, value, low, high in (("tp_size", tp_size, 1, 0xFFFF), ("rank", rank, 0, tp_size - 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"FileStore.{name}: expected an int in [{low}, {high}], got {value!r}")
        self.root = Path(root)
        self.shard = (rank, tp_size) if tp_size > 1 else (0, 0)
        self.pages_root = self.root / f"tp{tp_size}" / f"rank{rank}" if tp_size > 1 else self.root
        self.capacity_bytes = capacity_bytes or 0  # None: set below if the directory has a capacity
        self.layout = layout
        self.fsync = fsync
        self.delete_corrupt = delete_corrupt
        self.stats = StoreStats()
        self._chunk_pages = max(1, chunk_bytes // layout.page_bytes)
        self._limiter = trio.CapacityLimiter(threads)
        self._closed = False
        self._logged: set[tuple[str, int | None]] = set()
        self._index: PageIndex | None = None
        self._scratch = threading.local()  # per worker thread: a sealed page on its way
        try:
            for folder in (*reversed(self.pages_root.parents), self.pages_root):
                if not os.path.lexists(folder):  # every level it makes is 0700, not only the last
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(folder, DIR_MODE)
        except OSError as exc:
            self._log_error("open", exc, "the store misses every page and writes none")
        self._warn_if_open_to_others()
        raw, self.secret_source = self._secret(secret)
        if secret is not None:
            self.secret_source = secret_source
        self._cipher = PageCipher(raw)
        logger.info(
            "FileStore %s: pages sealed (AES-256-GCM) with keys from the secret from %s",
            self.root,
            self.secret_source,
        )
        self.leftovers_removed = remove_leftovers(self.pages_root, self._log_error)
        if self.capacity_bytes or capacity_bytes is None and regular(self.pages_root / INDEX_FILE):
            capacity = self.capacity_bytes or None  # None: join the capacity the index records
            self._index, evicted = open_index(
                self.root, self.pages_root, capacity, protected_fraction, self._log_error
            )
            self.stats.evicted += evicted
            if self._index is not None:
                self.capacity_bytes = self._index.capacity

    # ------------------------------------------------------------------------------------ setup

    def _warn_if_open_to_others(self) -> None:
        """Log once when other users may enter the store's folders: the pages stay sealed and
        0600, but they can see which pages exist and when they change."""
        for folder in dict.fromkeys((self.root, self.pages_root)):
            try:
                mode = stat.S_IMODE(os.stat(folder).st_mode)
            except OSError:
                continue
            if mode & 0o077:
                logger.warning(
                    "FileStore %s: folder %s has mode %04o: other users can list the page files "
                    "(their contents are sealed and 0600); chmod 700 it to hide them",
                    self.root,
                    folder,
                    mode,
                )

    def _secret(self, secret: bytes | str | None) -> tuple[bytes, str]:
        """The secret and where it came from: the argument, the environment, the key file, or
        (when the key file cannot be used) a random key of this store alone."""
        if secret is not None:
            return (secret.encode() if isinstance(secret, str) else secret), "argument"
        try:
            env = env_secret()  # stripped like the key file's contents
        except UntrustedSecret as exc:
            raise ValueError(f"FileStore: {exc}") from None
        if env is not None:
            return env, SECRET_ENV
        path = self.root / KEY_FILE
        try:
            return ensure_secret_file(path), str(path)
        except (OSError, UntrustedSecret) as exc:
            reason = describe(exc) if isinstance(exc, OSError) else str(exc)
            logger.warning(
                "FileStore %s: key file %s not used: %s; this store signs with a key of its own, so "
                "pages already there read as misses and other stores cannot read its pages "
                "(give every store the same secret, or set %s)",
                self.root,
                path,
                reason,
                SECRET_ENV,
            )
            return secrets.token_bytes(32), "random key of this store"

    def _touch(self, keys: list[int]) -> tuple[OSError, ...]:
        """Count a use of pages just found (worker thread); an index error only costs recency."""
        if self._index is None or not keys:
            return ()
        try:
            self._index.touch(f"{k:016x}" for k in keys)
        except sqlite3.Error as exc:
            return (index_error(exc, self._index.path),)
        return ()

    def used_bytes(self) -> int:
        """Bytes of page files the directory's index counts (0 for an unbounded store). Blocks."""
        return self._index.used() if self._index is not None else 0

    # ------------------------------------------------------------------------------------ paths

    def path(self, key: object) -> Path:
        """Where the page of `key` lives (validates the key)."""
        return self._path(key_values([key])[0])

    def _path(self, key: int) -> Path:
        name = f"{key:016x}"
        return self.pages_root / name[:2] / (name + SUFFIX)

    def _open_folder(self, key: int, *, create: bool) -> int:
        """An fd of the key's sub-folder; ELOOP if it is a symlink, ENOTDIR if not a folder."""
        folder = self.pages_root / f"{key:016x}"[:2]
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, DIR_MODE)
        return open_dir(folder)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"FileStore at {self.root} is closed")

    # ---------------------------------------------------------------------------------- errors

    def _log_error(self, op: str, exc: OSError, consequence: str) -> None:
        """Log an OS error the first time its kind (operation, errno) occurs in this store."""
        kind = (op, exc.errno)
        if kind in self._logged:
            return
        self._logged.add(kind)
        logger.warning(
            "FileStore %s: %s failed with %s; %s (later %s errors of this kind are only counted)",
            self.root,
            op,
            describe(exc),
            consequence,
            errno.errorcode.get(exc.errno or 0, type(exc).__name__),
        )

    def _log_errors(self, out: _Outcome, op: str) -> None:
        consequence = "the page reads as a miss" if op == "read" else "the page is reported not written"
        for exc in out.errors:
            self._log_error(op, exc, consequence)
        for exc in out.index_errors:
            self._log_error("index", exc, "a use of a page was not recorded (its recency is older)")

    # ------------------------------------------------------------------------------------- API

    async def exists(self, keys: Sequence[object]) -> int:
        values = key_values(keys)
        self._check_open()
        if not values:
            await trio.lowlevel.checkpoint()
            return 0
        out = await trio.to_thread.run_sync(self._count_present, values, limiter=self._limiter)
        self.stats.errors += len(out.errors)
        self._log_errors(out, "read")
        return out.done

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
            self.stats.errors += len(out.errors)
            self._log_errors(out, "read")
            done += out.done
            if progress is not None:
                progress(done)
            if out.cancelled:
                await trio.lowlevel.checkpoint()  # raises Cancelled; the thread has returned
            if out.done < len(values[start:end]):
                break
        return done

    async def put(self, keys: Sequence[object], pool: KVPool, pages: PageIndices) -> list[int]:
        """Write every page not already present; return the positions not written (OS errors)."""
        values, idx = check_batch("FileStore.put", self.layout, keys, pool, pages, into_pool=False)
        self._check_open()
        await trio.lowlevel.checkpoint()
        rows = pool.bytes_view().numpy()
        failed: list[int] = []
        gone: set[int] = set()  # keys of this batch evicted again by its own later pages
        refused = 0
        for start in range(0, len(values), self._chunk_pages):
            end = start + self._chunk_pages
            out = await trio.to_thread.run_sync(
                self._write_pages, values[start:end], idx[start:end], rows, gone, limiter=self._limiter
            )
            self.stats.written += out.done
            self.stats.skipped += out.skipped
            self.stats.evicted += out.evicted
            self.stats.bytes_written += out.done * self.layout.page_bytes
            self._log_errors(out, "write")
            failed += [start + j for j in out.failed]
            refused += out.refused
            if out.errors and out.errors[-1].errno in FS_WIDE:
                failed += range(end, len(values))  # the file system refuses: do not try the rest
                break
        self.stats.errors += len(failed) - refused
        if gone:  # a batch larger than the capacity evicts some of its own pages again
            failed = sorted({*failed, *(i for i, key in enumerate(values) if key in gone)})
        return failed

    async def aclose(self) -> None:
        self._closed = True
        if self._index is not None:
            await trio.to_thread.run_sync(self._index.close, limiter=self._limiter)
        else:
            await trio.lowlevel.checkpoint()

    # ---------------------------------------------------------------------- worker-thread side

    def _count_present(self, keys: list[int]) -> _Outcome:
        size = HEADER_SIZE + self.layout.page_bytes
        for i, key in enumerate(keys):
            try:
                folder = self._open_folder(key, create=False)
                try:
                    st = os.stat(f"{key:016x}{SUFFIX}", dir_fd=folder, follow_symlinks=False)
                finally:
                    os.close(folder)
            except FileNotFoundError:
                return _Outcome(done=i, index_errors=self._touch(keys[:i]))
            except OSError as exc:
                return _Outcome(done=i, errors=(exc,), index_errors=self._touch(keys[:i]))
            if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):  # what `get` would meet
                code = errno.ELOOP if stat.S_ISLNK(st.st_mode) else errno.EISDIR
                exc = OSError(code, os.strerror(code), str(self._path(key)))
                return _Outcome(done=i, errors=(exc,), index_errors=self._touch(keys[:i]))
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return _Outcome(done=i, index_errors=self._touch(keys[:i]))
        return _Outcome(done=len(keys), index_errors=self._touch(keys))

    def _read_pages(self, keys: list[int], pages: list[int], rows: np.ndarray) -> _Outcome:
        out = self._read_pages_untouched(keys, pages, rows)
        return attrs.evolve(out, index_errors=self._touch(keys[: out.done]))

    def _read_pages_untouched(self, keys: list[int], pages: list[int], rows: np.ndarray) -> _Outcome:
        for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
            if i and _caller_cancelled():
                return _Outcome(done=i, cancelled=True)
            try:
                status = self._read_page(key, rows[page])
            except OSError as exc:
                return _Outcome(done=i, errors=(exc,))
            if status != "ok":
                return _Outcome(done=i, misses=int(status == "missing"), corrupt=int(status == "corrupt"))
        return _Outcome(done=len(keys))

    def _read_page(self, key: int, out: np.ndarray) -> str:
        """Read one page straight into `out`: 'ok', 'missing' or 'corrupt'; any other OS error
        than a missing file raises."""
        name = f"{key:016x}{SUFFIX}"
        try:
            folder = self._open_folder(key, create=False)
        except FileNotFoundError:
            return "missing"
        try:
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=folder)
            except FileNotFoundError:
                return "missing"
            try:
                ok = self._verify_into(fd, key, out)
            finally:
                os.close(fd)
            if ok:
                return "ok"
            if self.delete_corrupt:
                with contextlib.suppress(OSError):  # a page left in place still reads as a miss
                    os.unlink(name, dir_fd=folder)
            return "corrupt"
        finally:
            os.close(folder)

    def _sealed(self) -> np.ndarray:
        """This worker thread's buffer for one sealed page: ciphertext, then the tag."""
        buf: np.ndarray | None = getattr(self._scratch, "buf", None)
        if buf is None:
            buf = self._scratch.buf = np.empty(self.layout.page_bytes + TAG_SIZE, dtype=np.uint8)
        return buf

    def _verify_into(self, fd: int, key: int, out: np.ndarray) -> bool:
        """Read page file `fd` and open it into `out`; whether it is a whole page of `key` that
        the cluster secret sealed (its tag checks)."""
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(self._path(key)))
        if not stat.S_ISREG(st.st_mode) or st.st_size != HEADER_SIZE + out.nbytes:
            return False
        f = io.FileIO(fd, "rb", closefd=False)
        header = f.read(HEADER_SIZE)
        if len(header) != HEADER_SIZE or page_version(header) != VERSION:
            return False
        sealed = self._sealed()
        if self._read_payload(fd, sealed[: out.nbytes]) != out.nbytes:
            return False
        return self._cipher.open_into(header, key, self.layout, sealed, out, self.shard)

    def _read_payload(self, fd: int, out: np.ndarray) -> int:
        """Read a page's payload, which starts at HEADER_SIZE, into `out`; the bytes read."""
        os.lseek(fd, HEADER_SIZE, os.SEEK_SET)
        return read_full(io.FileIO(fd, "rb", closefd=False), memoryview(out))

    def _write_payload(self, fd: int, payload: np.ndarray) -> None:
        """Write a page's payload after its header (the file holds just the header so far)."""
        write_all(fd, memoryview(payload))

    def _write_pages(self, keys: list[int], pages: list[int], rows: np.ndarray, gone: set[int]) -> _Outcome:
        written = skipped = refused = 0
        failed: list[int] = []
        errors: list[OSError] = []
        evicted = 0
        for j, (key, page) in enumerate(zip(keys, pages, strict=True)):
            try:
                victims = self._write_page(key, rows[page])
                if victims is not None:
                    written += 1
                    evicted += len(victims)
                    gone.discard(key)
                    gone.update(victims)
                else:
                    skipped += 1
            except NoRoom as exc:
                failed.append(j)
                refused += 1
                self._log_refusal(exc)
            except OSError as exc:
                failed.append(j)
                errors.append(exc)
                if exc.errno in FS_WIDE:
                    failed += range(j + 1, len(keys))
                    break
        return _Outcome(
            done=written,
            skipped=skipped,
            failed=tuple(failed),
            errors=tuple(errors),
            evicted=evicted,
            refused=refused,
        )

    def _log_refusal(self, exc: NoRoom) -> None:
        if ("capacity", None) not in self._logged:
            self._logged.add(("capacity", None))
            logger.warning("FileStore %s: a page was not written: %s", self.pages_root, exc)

    def _current_page_there(self, name: str, folder: int, size: int) -> bool:
        """Whether a whole-sized page file of this format is at `name` (a page of an older
        format, say unsealed, is written over rather than kept as a permanent miss)."""
        try:
            st = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=folder)
        except OSError:
            return False  # gone meanwhile, or unreadable: write it again
        try:
            return page_version(os.read(fd, 16)) == VERSION
        finally:
            os.close(fd)

    def _write_page(self, key: int, payload: np.ndarray) -> list[int] | None:
        """Write one page unless a whole-sized page file is there already (None), evicting for
        it in a bounded store; return the keys evicted. OS errors raise, and leave no temporary
        file behind."""
        name = f"{key:016x}{SUFFIX}"
        if self.capacity_bytes and self._index is None:
            raise OSError(errno.EIO, "no usable page index, so no room can be counted", str(self.pages_root))
        folder = self._open_folder(key, create=True)
        try:
            if self._current_page_there(name, folder, HEADER_SIZE + payload.nbytes):
                return None
            tmp = temp_name(key)
            fd = os.open(tmp, CREATE_FLAGS, FILE_MODE, dir_fd=folder)
            try:
                try:
                    sealed = self._sealed()
                    write_all(fd, self._cipher.seal(key, self.layout, payload, sealed, self.shard))
                    self._write_payload(fd, sealed[: payload.nbytes])
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)

                def place() -> None:
                    # Replaces whatever is at the name (a symlink included) without following it.
                    os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)

                victims: list[str] = []
                if self._index is None:
                    place()
                else:
                    try:
                        victims = self._index.admit(
                            f"{key:016x}",
                            HEADER_SIZE + payload.nbytes,
                            place,
                            functools.partial(remove_page, self.pages_root),
                        )
                    except sqlite3.Error as exc:
                        raise index_error(exc, self._index.path) from exc
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
            if self.fsync:
                os.fsync(folder)
            return [int(v, 16) for v in victims if isinstance(v, str) and KEY_NAME.fullmatch(v)]
        finally:
            os.close(folder)


def _caller_cancelled() -> bool:
    """In a worker thread of `trio.to_thread.run_sync`: whether its caller was cancelled."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled:
        return True
    return False
