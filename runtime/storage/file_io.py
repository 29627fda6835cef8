"""The file system calls of the file store: nothing followed through a symlink, short reads and
writes carried on to the end, and an OS error described with what it means for a page store."""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted as a page file must not block the worker thread in open().
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Conditions of the whole file system: the rest of a batch would fail the same way.
FS_WIDE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
HINTS = {
    errno.ELOOP: "a symlink where a page file, sub-folder or key file must be; not followed",
    errno.ENOTDIR: "a page sub-folder that is not a directory",
    errno.EISDIR: "a directory where a page file must be",
}


def describe(exc: OSError) -> str:
    """`exc` in one line: errno name, message, file, and what it means here."""
    name = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    where = f": {exc.filename}" if exc.filename is not None else ""
    hint = f"; {HINTS[exc.errno]}" if exc.errno in HINTS else ""
    return f"{name} ({exc.strerror or exc}{where}{hint})"


def open_dir(path: str | Path, dir_fd: int | None = None) -> int:
    """Open a real directory; a symlink there raises ELOOP (Linux says ENOTDIR: say why)."""
    try:
        return os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except NotADirectoryError as exc:
        try:
            link = stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from exc
        raise


def regular(path: Path) -> bool:
    """Whether `path` is a regular file (not followed if a symlink)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_full(f: io.FileIO, view: memoryview) -> int:
    """Fill `view` from the raw file `f`; fewer bytes only at end of file."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of `data` (os.write may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]
