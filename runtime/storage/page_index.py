"""The shared index of a bounded file store: which page files a directory holds, their sizes and
their order of eviction, kept in one SQLite file next to the pages so that every process using
the directory evicts by the same rule and the same capacity.

Policy: segmented LRU (SLRU). A page enters the *probation* segment when it is written; its first
use (a `get` hit, or an `exists` hit) moves it to the *protected* segment, which holds at most
`protected_fraction` of the capacity (when it overflows, its least recently used page goes back
to probation as that segment's most recently used). Eviction takes probation's least recently used page first,
protected's only when probation is empty. A long one-off scan of new pages therefore only ever
competes with other pages that were never read again, and the pages that are reused stay.
SLRU rather than 2Q or ARC: it needs one segment bit and one recency order per page and no
history of evicted keys, so the shared state stays one small table that every process updates
in short transactions.

Why SQLite: it gives the processes that share a directory one lock (a write transaction) and a
crash-safe table (write-ahead log) without a daemon; the lock is held only for bookkeeping,
unlinking victims and renaming a finished page into place — never while a page's bytes are
written or read. Recency is a logical clock in the index, not a file time, so it is exact across
processes and independent of how the file system keeps atime/mtime. Files the index does not
know (written by an unbounded store, or left by a crash between rename and commit) are adopted
at open, ordered by mtime; rows whose file is gone are dropped then, and otherwise age out.
The directory needs a file system whose locks work across its users (a local disk, or a shared
one with POSIX locks; SQLite's own advice against NFS without them applies).

All methods block and are meant for worker threads; one lock serialises this process's threads.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

INDEX_FILE = ".hicache-index.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pages (
    name TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    protected INTEGER NOT NULL,
    tick INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS pages_by_age ON pages (protected, tick);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL) WITHOUT ROWID;
INSERT OR IGNORE INTO meta VALUES ('clock', 0), ('used', 0), ('protected', 0), ('capacity', 0);
"""


class NoRoom(Exception):
    """A page larger than the whole capacity, or no page left that may be evicted for it."""


class BadIndex(sqlite3.DatabaseError):
    """Index contents that make no sense (the file is input from the disk like any other)."""


class PageIndex:
    """SLRU bookkeeping of the page files under one directory, shared through `path`.

    `capacity` bounds the sum of the sizes of indexed files and is recorded in the index; None
    joins an existing index with the capacity recorded there (`NoRoom` if there is none).
    `protected_fraction` of the capacity at most is protected. `timeout` is how long a
    transaction waits for another process's lock.
    """

    def __init__(
        self, path: Path, capacity: int | None, *, protected_fraction: float = 0.8, timeout: float = 10.0
    ) -> None:
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
        ):
            raise ValueError(f"PageIndex.capacity: expected an int >= 1, got {capacity!r}")
        if not 0.0 <= protected_fraction < 1.0:
            raise ValueError(f"PageIndex.protected_fraction: expected [0, 1), got {protected_fraction!r}")
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
        try:
            capacity = self._set_up(capacity, timeout)
        except BaseException:
            self._db.close()
            raise
        self.capacity: int = capacity
        self.protected_capacity = math.floor(capacity * protected_fraction)

    def _set_up(self, capacity: int | None, timeout: float) -> int:
        """WAL mode, the schema and the capacity, retried while another process holds the file:
        switching a new file to WAL answers "database is locked" at once, without the busy
        wait, when two processes open the same directory at the same moment. Every step is
        idempotent."""
        deadline = time.monotonic() + timeout
        pause = 0.005
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.executescript(_SCHEMA)
                if capacity is None:
                    joined = self._meta(self._db, "capacity")
                    if not joined:
                        raise NoRoom(f"{self.path}: no capacity recorded to join")
                    return joined
                self._db.execute("UPDATE meta SET v = ? WHERE k = 'capacity'", (capacity,))
                return capacity
            except sqlite3.OperationalError as exc:
                busy = exc.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
                if not busy or time.monotonic() + pause > deadline:
                    raise
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                time.sleep(pause)
                pause = min(2 * pause, 0.2)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --------------------------------------------------------------------------- transactions

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: this process's threads in turn, other processes waited for."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                if isinstance(exc, TypeError | ValueError | IndexError):  # rows of the wrong shape
                    raise BadIndex(f"index contents: {exc}") from exc
                raise
            db.execute("COMMIT")

    @staticmethod
    def _meta(db: sqlite3.Connection, key: str) -> int:
        row = db.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        if row is None or not isinstance(row[0], int):
            raise BadIndex(f"meta {key!r} is {row!r}, expected an integer")
        return row[0]

    def _recount(self, db: sqlite3.Connection) -> None:
        """Set the byte totals from the rows again (after they were found not to match)."""
        used, protected = db.execute("SELECT TOTAL(size), TOTAL(size * protected) FROM pages").fetchone()
        db.execute("UPDATE meta SET v = ? WHERE k = 'used'", (int(used),))
        db.execute("UPDATE meta SET v = ? WHERE k = 'protected'", (int(protected),))

    def _purge(self, db: sqlite3.Connection) -> None:
        """Drop rows no version writes (wrong types or values), then recount the totals."""
        db.execute(
            "DELETE FROM pages WHERE typeof(name) != 'text' OR typeof(size) != 'integer' OR size < 0"
            " OR protected NOT IN (0, 1) OR typeof(tick) != 'integer'"
        )
        self._recount(db)

    def _oldest(self, db: sqlite3.Connection) -> tuple[str, int, int] | None:
        """The next victim: probation's least recently used page, else protected's."""
        query = "SELECT name, size, protected FROM pages ORDER BY protected, tick LIMIT 1"
        row = db.execute(query).fetchone()
        if row is not None and not (isinstance(row[0], str) and isinstance(row[1], int) and row[1] >= 0):
            self._purge(db)
            row = db.execute(query).fetchone()
        return row

    @staticmethod
    def _add(db: sqlite3.Connection, key: str, delta: int) -> None:
        db.execute("UPDATE meta SET v = v + ? WHERE k = ?", (delta, key))

    def _tick(self, db: sqlite3.Connection) -> int:
        self._add(db, "clock", 1)
        return self._meta(db, "clock")

    # --------------------------------------------------------------------------------- reads

    def used(self) -> int:
        """Bytes of the indexed page files."""
        with self._lock:
            return self._meta(self._db, "used")

    def entries(self) -> list[tuple[str, int, bool]]:
        """(name, size, protected) of every indexed page, least recently used first, probation
        before protected: the order in which they would be evicted (ignoring demotions)."""
        with self._lock:
            rows = self._db.execute("SELECT name, size, protected FROM pages ORDER BY protected, tick")
            return [(n, s, bool(p)) for n, s, p in rows]

    # ------------------------------------------------------------------------------- updates

    def admit(
        self, name: str, size: int, place: Callable[[], None], remove: Callable[[str], None]
    ) -> list[str]:
        """Make room for a page of `size` bytes and index it, calling `place()` (which puts its
        file in place) inside the transaction; return the names evicted for it.

        `remove(victim)` deletes a victim's file; an error from it or from `place` ends the
        transaction (the victims removed so far stay removed) and is raised. A page already
        indexed (another writer's, or a row whose file was lost) is placed without new room."""
        if size > self.capacity:
            raise NoRoom(f"a page of {size} bytes is larger than the capacity of {self.capacity}")
        evicted: list[str] = []
        with self._write() as db:
            if db.execute("SELECT 1 FROM pages WHERE name = ?", (name,)).fetchone() is not None:
                place()
                return evicted
            try:
                while self._meta(db, "used") + size > self.capacity:
                    victim = self._oldest(db)
                    if victim is None:  # the totals were wrong: nothing is indexed
                        self._recount(db)
                        continue
                    remove(victim[0])
                    self._drop(db, *victim)
                    evicted.append(victim[0])
                place()
            except BaseException:
                if db.in_transaction:
                    db.execute("COMMIT")  # the removals happened: their rows stay dropped
                raise
            db.execute("INSERT INTO pages VALUES (?, ?, 0, ?)", (name, size, self._tick(db)))
            self._add(db, "used", size)
        return evicted

    def _drop(self, db: sqlite3.Connection, name: str, size: int, protected: int) -> None:
        db.execute("DELETE FROM pages WHERE name = ?", (name,))
        self._add(db, "used", -size)
        if protected:
            self._add(db, "protected", -size)

    def touch(self, names: Iterable[str]) -> None:
        """Count a use of each page: the most recently used of the protected segment."""
        names = list(names)
        if not names:
            return
        with self._write() as db:
            for name in names:
                row = db.execute("SELECT size, protected FROM pages WHERE name = ?", (name,)).fetchone()
                if row is None:
                    continue  # evicted meanwhile, or a file the index does not know yet
                db.execute("UPDATE pages SET protected = 1, tick = ? WHERE name = ?", (self._tick(db), name))
                if not row[1]:
                    self._add(db, "protected", row[0])
            while self._meta(db, "protected") > self.protected_capacity:
                row = db.execute(
                    "SELECT name, size FROM pages WHERE protected = 1 ORDER BY tick LIMIT 1"
                ).fetchone()
                if row is None:  # the total was wrong
                    self._recount(db)
                    continue
                name, size = row
                db.execute("UPDATE pages SET protected = 0, tick = ? WHERE name = ?", (self._tick(db), name))
                self._add(db, "protected", -size)

    def reconcile(
        self,
        found: dict[str, tuple[int, float]],
        still_there: Callable[[str], tuple[int, float] | None],
        remove: Callable[[str], None],
    ) -> tuple[int, int, list[str]]:
        """Align the index with the files `found` by a scan (name -> (size, mtime)): adopt files
        it lacks (oldest first, into probation), drop rows whose file is gone, and evict down to
        the capacity. `still_there(name)` re-checks a file under the lock (another process may
        have written or evicted it since the scan). Returns (adopted, dropped, evicted)."""
        adopted = dropped = 0
        evicted: list[str] = []
        with self._write() as db:
            self._purge(db)
            known = {n: (s, p) for n, s, p in db.execute("SELECT name, size, protected FROM pages")}
            for name in [n for n in known if n not in found]:
                if still_there(name) is None:
                    self._drop(db, name, *known[name])
                    dropped += 1
            new = sorted((mtime, name, size) for name, (size, mtime) in found.items() if name not in known)
            for _, name, _ in new:
                current = still_there(name)
                if current is None:
                    continue
                db.execute("INSERT INTO pages VALUES (?, ?, 0, ?)", (name, current[0], self._tick(db)))
                self._add(db, "used", current[0])
                adopted += 1
            self._recount(db)  # a crash may have left the totals off
            while self._meta(db, "used") > self.capacity:
                victim = self._oldest(db)
                assert victim is not None  # recounted: a positive total has rows
                remove(victim[0])
                self._drop(db, *victim)
                evicted.append(victim[0])
        return adopted, dropped, evicted
