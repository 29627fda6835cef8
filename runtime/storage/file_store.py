"""L3 on a file system: one file per page, shared by every node that mounts the same directory.

A page file is a fixed-size header followed by the page's raw bytes:

    offset size  field
    0      8     magic b"HICKVPG\\0"
    8      2     format version (2)
    10     2     header size (128)
    12     4     reserved (0)
    16     8     page key
    24     20    page shape, 5 x uint32 (layers, 2, page_size, kv_heads, head_dim)
    44     16    dtype name, ASCII, NUL-padded
    60     8     payload length in bytes
    68     28    reserved (0)
    96     32    MAC: keyed BLAKE2b-256 of bytes [0, 96) and the payload

all little-endian. The MAC key comes from a cluster secret (`FileStore(secret=...)`, else the
environment variable HICACHE_CLUSTER_SECRET, else a random secret the first store writes to
`ROOT/.hicache-secret` with mode 0600), so a page nobody with the secret wrote — forged by
whoever can write the directory, damaged, or in version 1's unkeyed CRC-32 format — reads as a
miss. The MAC covers the key and layout fields too: a valid page copied under another key's
name is a miss as well.

Files are written to a temporary name in the same directory and renamed over the final name
(`os.replace` is atomic on POSIX), so a reader sees a whole page or none. A temporary's name
carries its writer's host and pid; a store opening the directory removes the temporaries of
writers on this host that are gone, never a live neighbour's. Nothing outside the root is read
or written: file names come from validated keys only, sub-folders and page files are opened
with O_NOFOLLOW (a symlink there is an error, never followed, also by the start-up clean-up).

No input from the disk stops a node: every OS error of `exists`, `get` or `put` is a miss or a
page reported not written (`stats.errors` counts them), logged once per kind (read or write,
errno) with its reason on the `hicache.runtime.storage` logger; an error while opening the store
leaves a store that misses and writes nothing where the disk refuses.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import hmac
import io
import logging
import os
import re
import secrets
import socket
import stat
import struct
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import trio

from hicache.runtime.cluster_secret import SECRET_ENV, UntrustedSecret, ensure_secret_file
from hicache.runtime.kv_layout import KVLayout
from hicache.runtime.kv_pool import KVPool, PageIndices
from hicache.runtime.storage.base import Progress, StoreStats, check_batch, key_values

logger = logging.getLogger("hicache.runtime.storage")

MAGIC = b"HICKVPG\0"
VERSION = 2
MAC_SIZE = 32
_SIGNED = struct.Struct("<8sHHIQ5I16sQ28x")  # the header fields the MAC follows
HEADER = struct.Struct(_SIGNED.format + f"{MAC_SIZE}s")
HEADER_SIZE = HEADER.size
SUFFIX = ".kvpage"
KEY_FILE = ".hicache-secret"
_FANOUT = re.compile(r"[0-9a-f]{2}")
_TEMP = re.compile(r"\.[0-9a-f]{16}\.([0-9a-f]{8})\.([0-9]{1,10})\.[0-9a-f]{12}\.tmp")
_KEY_PERSON = b"hicache-l3-key"
_PAGE_PERSON = b"hicache-l3-page"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted as a page file must not block the worker thread in open().
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Conditions of the whole file system: the rest of a batch would fail the same way.
_FS_WIDE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
_HINTS = {
    errno.ELOOP: "a symlink where a page file, sub-folder or key file must be; not followed",
    errno.ENOTDIR: "a page sub-folder that is not a directory",
    errno.EISDIR: "a directory where a page file must be",
}

assert HEADER_SIZE == 128 and _SIGNED.size == HEADER_SIZE - MAC_SIZE, HEADER_SIZE


def mac_key(secret: bytes) -> bytes:
    """The BLAKE2b key of page MACs for a cluster secret of any length."""
    return hashlib.blake2b(secret, digest_size=32, person=_KEY_PERSON).digest()


def page_mac(key: bytes, signed: bytes, payload: bytes | memoryview | np.ndarray) -> bytes:
    """The MAC of a page file: keyed BLAKE2b over its header fields and its payload."""
    h = hashlib.blake2b(signed, key=key, digest_size=MAC_SIZE, person=_PAGE_PERSON)
    h.update(payload)
    return h.digest()


def pack_header(key: int, layout: KVLayout, payload: bytes | memoryview | np.ndarray, mac: bytes) -> bytes:
    """The header of a page file holding `payload` under `key`, signed with MAC key `mac`."""
    signed = _SIGNED.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        0,
        key,
        *layout.page_shape,
        layout.dtype.encode("ascii"),
        layout.page_bytes,
    )
    return signed + page_mac(mac, signed, payload)


@functools.cache
def host_tag() -> str:
    """This host and pid namespace, as 8 hex digits: a pid means something only where it runs."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return hashlib.blake2b(f"{socket.gethostname()}/{namespace}".encode(), digest_size=4).hexdigest()


def temp_name(key: int, pid: int | None = None) -> str:
    """A temporary page file's name: key, writer's host and pid, and a random part."""
    return f".{key:016x}.{host_tag()}.{os.getpid() if pid is None else pid}.{secrets.token_hex(6)}.tmp"


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` (on this host) may still be writing; when unsure, yes."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # PermissionError: it exists, under another user
    try:  # a killed writer nobody reaped yet is a zombie: it writes nothing any more
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _describe(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    where = f": {exc.filename}" if exc.filename is not None else ""
    hint = f"; {_HINTS[exc.errno]}" if exc.errno in _HINTS else ""
    return f"{name} ({exc.strerror or exc}{where}{hint})"


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


class FileStore:
    """Page files under `root/<first two hex digits of the key>/<key>.kvpage`.

    `secret` (bytes or str) keys the page MACs; without it the store uses HICACHE_CLUSTER_SECRET,
    else `root/.hicache-secret` (see the module docstring); `secret_source` says which. Nodes
    share pages only if they share the secret. `fsync=True` makes a completed `put` durable across
    a power loss (fsync of the file and its directory) at the cost of a disk flush per page;
    without it a crash may lose recent pages but never exposes a partial one.
    `delete_corrupt=True` removes a page file that fails verification so the next `put` of that
    key rewrites it. Blocking I/O runs on worker threads under the store's own limiter of
    `threads` tokens; `get` and `put` hand batches of about `chunk_bytes` to a thread at a time so
    a cancellation takes effect between batches. A cancelled `get` waits for its thread, which
    stops at the next page boundary: the pages it read are reported (`progress`), and nothing
    writes to the pool once `get` has raised.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        layout: KVLayout,
        *,
        secret: bytes | str | None = None,
        fsync: bool = False,
        delete_corrupt: bool = False,
        threads: int = 2,
        chunk_bytes: int = 16 << 20,
    ) -> None:
        if len(layout.dtype) > 16:
            raise ValueError(f"FileStore: dtype name {layout.dtype!r} does not fit the 16-byte header field")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"FileStore.threads: expected an int >= 1, got {threads!r}")
        if secret is not None and not isinstance(secret, bytes | str):
            raise ValueError(f"FileStore.secret: expected bytes or str, got {type(secret).__name__}")
        if secret is not None and not secret:
            raise ValueError("FileStore.secret: an empty secret authenticates nothing")
        self.root = Path(root)
        self.layout = layout
        self.fsync = fsync
        self.delete_corrupt = delete_corrupt
        self.stats = StoreStats()
        self._chunk_pages = max(1, chunk_bytes // layout.page_bytes)
        self._limiter = trio.CapacityLimiter(threads)
        self._closed = False
        self._logged: set[tuple[str, int | None]] = set()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._log_error("open", exc, "the store misses every page and writes none")
        self._mac, self.secret_source = self._secret(secret)
        logger.info("FileStore %s: page MACs keyed by the secret from %s", self.root, self.secret_source)
        self.leftovers_removed = self._remove_leftovers()

    # ------------------------------------------------------------------------------------ setup

    def _secret(self, secret: bytes | str | None) -> tuple[bytes, str]:
        """The MAC key and where its secret came from: the argument, the environment, the key
        file, or (when the key file cannot be used) a random key of this store alone."""
        if secret is not None:
            return mac_key(secret.encode() if isinstance(secret, str) else secret), "argument"
        env = os.environ.get(SECRET_ENV, "").strip()  # stripped like the key file's contents
        if env:
            return mac_key(env.encode()), SECRET_ENV
        path = self.root / KEY_FILE
        try:
            return mac_key(ensure_secret_file(path)), str(path)
        except (OSError, UntrustedSecret) as exc:
            reason = _describe(exc) if isinstance(exc, OSError) else str(exc)
            logger.warning(
                "FileStore %s: key file %s not used: %s; this store signs with a key of its own, so "
                "pages already there read as misses and other stores cannot read its pages "
                "(give every store the same secret, or set %s)",
                self.root,
                path,
                reason,
                SECRET_ENV,
            )
            return mac_key(secrets.token_bytes(32)), "random key of this store"

    def _remove_leftovers(self) -> int:
        """Remove temporary files of writers on this host that are gone; follow no symlink."""
        removed = 0
        try:
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            self._log_error("open", exc, "no temporary files were cleaned up")
            return 0
        try:
            with os.scandir(root) as entries:
                folders = [e.name for e in entries if _FANOUT.fullmatch(e.name)]
            for name in folders:
                try:
                    folder = _open_dir(name, dir_fd=root)
                except OSError as exc:
                    self._log_error("open", exc, "that sub-folder was not cleaned up")
                    continue
                try:
                    with os.scandir(folder) as entries:
                        temps = [e.name for e in entries if self._writer_gone(e.name)]
                    for temp in temps:
                        try:
                            os.unlink(temp, dir_fd=folder)
                            removed += 1
                        except FileNotFoundError:
                            pass
                        except OSError as exc:
                            self._log_error("open", exc, "a leftover temporary file stays")
                finally:
                    os.close(folder)
        except OSError as exc:
            self._log_error("open", exc, "temporary files were not all cleaned up")
        finally:
            os.close(root)
        return removed

    @staticmethod
    def _writer_gone(name: str) -> bool:
        m = _TEMP.fullmatch(name)
        return m is not None and m[1] == host_tag() and not _pid_alive(int(m[2]))

    # ------------------------------------------------------------------------------------ paths

    def path(self, key: object) -> Path:
        """Where the page of `key` lives (validates the key)."""
        return self._path(key_values([key])[0])

    def _path(self, key: int) -> Path:
        name = f"{key:016x}"
        return self.root / name[:2] / (name + SUFFIX)

    def _open_folder(self, key: int, *, create: bool) -> int:
        """An fd of the key's sub-folder; ELOOP if it is a symlink, ENOTDIR if not a folder."""
        folder = self.root / f"{key:016x}"[:2]
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder)
        return _open_dir(folder)

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
            _describe(exc),
            consequence,
            errno.errorcode.get(exc.errno or 0, type(exc).__name__),
        )

    def _log_errors(self, out: _Outcome, op: str) -> None:
        consequence = "the page reads as a miss" if op == "read" else "the page is reported not written"
        for exc in out.errors:
            self._log_error(op, exc, consequence)

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
        for start in range(0, len(values), self._chunk_pages):
            end = start + self._chunk_pages
            out = await trio.to_thread.run_sync(
                self._write_pages, values[start:end], idx[start:end], rows, limiter=self._limiter
            )
            self.stats.written += out.done
            self.stats.skipped += out.skipped
            self.stats.bytes_written += out.done * self.layout.page_bytes
            self._log_errors(out, "write")
            failed += [start + j for j in out.failed]
            if out.errors and out.errors[-1].errno in _FS_WIDE:
                failed += range(end, len(values))  # the file system refuses: do not try the rest
                break
        self.stats.errors += len(failed)
        return failed

    async def aclose(self) -> None:
        self._closed = True
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
                return _Outcome(done=i)
            except OSError as exc:
                return _Outcome(done=i, errors=(exc,))
            if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):  # what `get` would meet
                code = errno.ELOOP if stat.S_ISLNK(st.st_mode) else errno.EISDIR
                return _Outcome(done=i, errors=(OSError(code, os.strerror(code), str(self._path(key))),))
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return _Outcome(done=i)
        return _Outcome(done=len(keys))

    def _read_pages(self, keys: list[int], pages: list[int], rows: np.ndarray) -> _Outcome:
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
                fd = os.open(name, _READ_FLAGS, dir_fd=folder)
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

    def _verify_into(self, fd: int, key: int, out: np.ndarray) -> bool:
        """Read page file `fd` into `out`; whether it is a whole page of `key` with a valid MAC."""
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(self._path(key)))
        if not stat.S_ISREG(st.st_mode) or st.st_size != HEADER_SIZE + out.nbytes:
            return False
        f = io.FileIO(fd, "rb", closefd=False)
        header = f.read(HEADER_SIZE)
        if len(header) != HEADER_SIZE or not self._header_matches(key, header):
            return False
        if _read_full(f, memoryview(out)) != out.nbytes:
            return False
        expected = page_mac(self._mac, header[: _SIGNED.size], out)
        return hmac.compare_digest(header[_SIGNED.size :], expected)

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
        failed: list[int] = []
        errors: list[OSError] = []
        for j, (key, page) in enumerate(zip(keys, pages, strict=True)):
            try:
                if self._write_page(key, rows[page]):
                    written += 1
                else:
                    skipped += 1
            except OSError as exc:
                failed.append(j)
                errors.append(exc)
                if exc.errno in _FS_WIDE:
                    failed += range(j + 1, len(keys))
                    break
        return _Outcome(done=written, skipped=skipped, failed=tuple(failed), errors=tuple(errors))

    def _write_page(self, key: int, payload: np.ndarray) -> bool:
        """Write one page unless a whole-sized page file is there already (False); OS errors
        raise, and leave no temporary file behind."""
        name = f"{key:016x}{SUFFIX}"
        folder = self._open_folder(key, create=True)
        try:
            try:
                st = os.stat(name, dir_fd=folder, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_size == HEADER_SIZE + payload.nbytes:
                    return False
            except FileNotFoundError:
                pass
            tmp = temp_name(key)
            fd = os.open(tmp, _CREATE_FLAGS, 0o666, dir_fd=folder)
            try:
                try:
                    _write_all(fd, pack_header(key, self.layout, payload, self._mac))
                    _write_all(fd, memoryview(payload))
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                # Replaces whatever is at the name (a symlink included) without following it.
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
            if self.fsync:
                os.fsync(folder)
            return True
        finally:
            os.close(folder)


def _open_dir(path: str | Path, dir_fd: int | None = None) -> int:
    """Open a real directory; a symlink there raises ELOOP (Linux says ENOTDIR: say why)."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except NotADirectoryError as exc:
        try:
            link = stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from exc
        raise


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


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of `data` (os.write may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]
