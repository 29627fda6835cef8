"""What a file store finds in its directory and keeps in order there: the temporaries of
writers that are gone (a crash between writing a page and renaming it leaves one), the shared
index aligned with the page files it summarises (rebuilt from them when damaged), and the page
files eviction removes.

A temporary's name carries its writer's host and pid; a store opening the directory removes the
temporaries of writers on this host that are gone, never a live neighbour's, and follows no
symlink doing it. The page files are the truth: at open the index adopts the files it lacks,
drops what is gone and evicts what is over its capacity.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import re
import secrets
import socket
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path

from hicache.runtime.storage.file_io import open_dir
from hicache.runtime.storage.page_file import SUFFIX
from hicache.runtime.storage.page_index import INDEX_FILE, NoRoom, PageIndex

logger = logging.getLogger("hicache.runtime.storage")

FANOUT = re.compile(r"[0-9a-f]{2}")  # a page sub-folder: the first two hex digits of its keys
KEY_NAME = re.compile(r"[0-9a-f]{16}")
_PAGE = re.compile(r"[0-9a-f]{16}\.kvpage")
_TEMP = re.compile(r"\.[0-9a-f]{16}\.([0-9a-f]{8})\.([0-9]{1,10})\.[0-9a-f]{12}\.tmp")
_DAMAGED_INDEX = frozenset({sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT})

# How a store logs an OS error: (operation, error, what it means for the store).
LogError = Callable[[str, OSError, str], None]


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


def writer_gone(name: str) -> bool:
    """Whether `name` is a temporary page file whose writer, on this host, is gone."""
    m = _TEMP.fullmatch(name)
    return m is not None and m[1] == host_tag() and not _pid_alive(int(m[2]))


def remove_leftovers(pages_root: Path, log_error: LogError) -> int:
    """Remove temporary files of writers on this host that are gone; follow no symlink."""
    removed = 0
    try:
        root = os.open(pages_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        log_error("open", exc, "no temporary files were cleaned up")
        return 0
    try:
        with os.scandir(root) as entries:
            folders = [e.name for e in entries if FANOUT.fullmatch(e.name)]
        for name in folders:
            try:
                folder = open_dir(name, dir_fd=root)
            except OSError as exc:
                log_error("open", exc, "that sub-folder was not cleaned up")
                continue
            try:
                with os.scandir(folder) as entries:
                    temps = [e.name for e in entries if writer_gone(e.name)]
                for temp in temps:
                    try:
                        os.unlink(temp, dir_fd=folder)
                        removed += 1
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        log_error("open", exc, "a leftover temporary file stays")
            finally:
                os.close(folder)
    except OSError as exc:
        log_error("open", exc, "temporary files were not all cleaned up")
    finally:
        os.close(root)
    return removed


def open_index(
    root: Path, pages_root: Path, capacity: int | None, protected_fraction: float, log_error: LogError
) -> tuple[PageIndex | None, int]:
    """The directory's shared index, aligned with the page files there, and how many pages it
    evicted doing so; `root` names the store in logs. `capacity` None joins the capacity the
    index records. Without an index (the file unusable) a bounded store cannot keep its
    capacity: it reads but writes none."""
    path = pages_root / INDEX_FILE
    try:
        if path.is_symlink():
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
        _private(path)
        try:
            index = PageIndex(path, capacity, protected_fraction=protected_fraction)
        except NoRoom:
            return None, 0  # an index without a capacity: nothing to join, unbounded as before
        except sqlite3.DatabaseError as exc:
            if getattr(exc, "sqlite_errorcode", None) not in _DAMAGED_INDEX:
                raise
            # Damaged: rebuilt from the page files, which are the truth it only summarises.
            logger.warning("FileStore %s: index %s is damaged (%s); rebuilding it", root, path, exc)
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{path}{suffix}")
            index = PageIndex(path, capacity, protected_fraction=protected_fraction)
    except (OSError, sqlite3.Error, NoRoom) as exc:
        log_error("open", index_error(exc, path), "the store reads pages but writes none")
        return None, 0
    try:
        adopted, dropped, evicted = index.reconcile(
            scan_pages(pages_root, log_error),
            functools.partial(page_file_stat, pages_root),
            functools.partial(remove_page, pages_root),
        )
    except (OSError, sqlite3.Error) as exc:
        log_error("open", index_error(exc, path), "the index was not aligned with the files")
        return index, 0
    if adopted or dropped or evicted:
        logger.info(
            "FileStore %s: index adopted %d page files, dropped %d gone, evicted %d over capacity",
            pages_root,
            adopted,
            dropped,
            len(evicted),
        )
    return index, len(evicted)


def _private(path: Path) -> None:
    """Create the index file 0600 before SQLite does (it would use the umask, and its -wal and
    -shm files take the database's mode), and make one this user owns 0600 if it is not."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def scan_pages(pages_root: Path, log_error: LogError) -> dict[str, tuple[int, float]]:
    """Every page file's name (its key in hex), size and mtime; what cannot be read is left out."""
    found: dict[str, tuple[int, float]] = {}
    try:
        with os.scandir(pages_root) as entries:
            folders = [e.name for e in entries if FANOUT.fullmatch(e.name)]
    except OSError as exc:
        log_error("open", exc, "page files already there are not counted")
        return found
    for folder in folders:
        try:
            with os.scandir(pages_root / folder) as entries:
                for e in entries:
                    name = e.name.removesuffix(SUFFIX)
                    if _PAGE.fullmatch(e.name) and name.startswith(folder):
                        st = e.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            found[name] = (st.st_size, st.st_mtime)
        except OSError as exc:
            log_error("open", exc, "some page files already there are not counted")
    return found


def page_file_stat(pages_root: Path, name: str) -> tuple[int, float] | None:
    """Size and mtime of page file `name` (16 hex digits), None if it is not a regular file."""
    if not isinstance(name, str) or not KEY_NAME.fullmatch(name):
        return None
    try:
        st = os.stat(pages_root / name[:2] / (name + SUFFIX), follow_symlinks=False)
    except OSError:
        return None
    return (st.st_size, st.st_mtime) if stat.S_ISREG(st.st_mode) else None


def remove_page(pages_root: Path, name: str) -> None:
    """Evict page file `name`: one that is gone already counts as removed, and so does a name
    that no page file can have (the index is input from the disk too)."""
    if not isinstance(name, str) or not KEY_NAME.fullmatch(name):
        return
    try:
        folder = open_dir(pages_root / name[:2])
    except FileNotFoundError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            _unlink(name + SUFFIX, folder)
    finally:
        os.close(folder)


def _unlink(name: str, folder: int) -> None:
    """Remove an evicted page file (a seam for tests of a refused eviction)."""
    os.unlink(name, dir_fd=folder)


def index_error(exc: OSError | sqlite3.Error, path: Path) -> OSError:
    """An error of the page index as the OSError the store logs and counts."""
    if isinstance(exc, OSError):
        return exc
    return OSError(errno.EIO, f"page index: {exc}", str(path))
