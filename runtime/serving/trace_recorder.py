"""Recording the traffic a front door serves as a Mooncake trace without its text, so that it can
be replayed in the simulator (`scenarios/traces.py` reads it back).

The file's first line is a header, `{"hicache_trace_header": 1, ...}`: the serving node's
configuration. Then one line per request, appended and flushed as the request finishes (so lines
are in completion order; `timestamp` is the request's arrival, in ms since the recording began):
`input_length`, `output_length`, and `hash_ids`, one id per block of the prompt (the last block
possibly partial), chained: a block's id names the whole prefix through it. A block is the
node's page by default (`block_size` in the header), the granularity hits are decided at, so a
prompt shorter than a block never hides the prefix it shares; with a coarser block (Mooncake's 512
for other tools) `page_hash_ids` holds the per-page ids alongside.

Where each request's time to its KV went (`phases`, seconds): `door_wait_s` queued at the front
door (`admission.py`), then as the decode node measured them, `decode_wait_s` before the decode
node asked prefill for it, `prefill_wait_s` queued on prefill
or behind other prompts' chunks, `prefill_compute_s` its own forwards, `transfer_s` the rest of
that exchange. A calibration then fits service times to service, not to time spent queueing.

The arrival process, so that a replay can drive the clients as they behaved: `finished` (ms, when
the request ended), `previous_finished` (ms, when the previous turn of its session ended; absent
for a first turn) and `in_flight` (requests of this recording in flight when it arrived).

The ids come from the core's salted page keys (`hicache.core.pages`) at the block size, keyed by
the tenant's namespace, then numbered in first-seen order; that numbering lives only in memory.
So no text leaves the node, identical prompts of one tenant get the same ids and those of two
tenants never do. Tenants are written as a hash salted per recording, sessions as numbers in
first-seen order. Nothing is held per request once its line is written; a write error ends the
recording (logged) and never the request.

What the recording remembers across requests is bounded, whatever clients send: sessions by a
16-byte salted hash of (tenant, session), never the strings themselves, and at most
`MAX_SESSIONS` of them; block ids for at most `MAX_BLOCKS` blocks; namespace seeds for at most
`MAX_TENANTS` tenants. Each map forgets its least recently used entry first. A session or block
forgotten and seen again gets a new number (numbers are never reused), so a replay sees it as
new: the trace stays sound, only less complete for what went unused longest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import time
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from hicache.core.pages import namespace_seed, page_keys
from hicache.scenarios.traces import MOONCAKE_BLOCK, TRACE_HEADER

if TYPE_CHECKING:
    from hicache.runtime.serving.generation import Generation

log = logging.getLogger("hicache.runtime.serving")

HEADER_VERSION = 1
MAX_SESSIONS = 1 << 16  # about 10 MB of (hash, number) pairs
MAX_BLOCKS = 1 << 18  # 134M tokens of distinct 512-token blocks, about 30 MB
MAX_TENANTS = 1 << 10


class Numbering:
    """Numbers in first-seen order for at most `cap` keys, the least recently used forgotten
    first; a key seen again after that gets a new number (none is ever given twice)."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"Numbering.cap: expected an int >= 1, got {cap!r}")
        self.cap = cap
        self.given = 0  # numbers given so far: the next one
        self._of: OrderedDict[Hashable, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._of)

    def number(self, key: Hashable) -> int:
        n = self._of.get(key)
        if n is not None:
            self._of.move_to_end(key)
            return n
        n = self._of[key] = self.given
        self.given += 1
        if len(self._of) > self.cap:
            self._of.popitem(last=False)
        return n


class RecordingError(Exception):
    """A recording that cannot start; the message names the path and the reason. `conflict`:
    refused for what exists already (a recording running, a file of that name)."""

    def __init__(self, message: str, *, conflict: bool = False) -> None:
        super().__init__(message)
        self.conflict = conflict


def open_trace(path: Path) -> IO[bytes]:
    """A new trace file: never an existing one (each start writes its own file). Unbuffered:
    each line goes to the OS whole, in its own writes, when its request ends."""
    return path.open("xb", buffering=0)


class BlockIds:
    """Chained ids of `block_size`-token blocks: the page key of each block (a partial last block is keyed
    by its own tokens, chained from the block before), numbered in first-seen order."""

    def __init__(
        self, model_name: str, block_size: int = MOONCAKE_BLOCK, *, max_blocks: int = MAX_BLOCKS
    ) -> None:
        self.model_name = model_name
        self.block_size = block_size
        self._ids = Numbering(max_blocks)
        self._seeds: OrderedDict[str | None, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self, tokens: list[int], tenant: str | None) -> list[int]:
        seed = self._seeds.get(tenant)
        if seed is None:
            seed = self._seeds[tenant] = namespace_seed(self.model_name, tenant)
            if len(self._seeds) > MAX_TENANTS:
                self._seeds.popitem(last=False)
        else:
            self._seeds.move_to_end(tenant)
        arr = np.asarray(tokens, dtype=np.int64)
        keys = page_keys(arr, self.block_size, seed).tolist()
        tail = len(arr) % self.block_size
        if tail:  # its own length goes into its hash: it never equals a full block's key
            keys += page_keys(arr[-tail:], tail, keys[-1] if keys else seed).tolist()
        return [self._ids.number(k) for k in keys]


class Recording:
    """One trace file being written: the header first, then a line per finished request."""

    def __init__(
        self,
        path: Path,
        file: IO[bytes],
        model_name: str,
        header: Mapping[str, Any],
        block_size: int = MOONCAKE_BLOCK,
        *,
        page_size: int | None = None,
        max_sessions: int = MAX_SESSIONS,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        self.path = path
        self.began = time.monotonic()
        self.requests = 0
        self.error: str | None = None
        self._file: IO[bytes] | None = file
        self._whole = 0  # bytes of whole lines written: a failed write is cut back to here
        self._blocks = BlockIds(model_name, block_size, max_blocks=max_blocks)
        # Per-page ids beside coarser blocks (None: the blocks are pages, or the page is unknown).
        self._pages = (
            BlockIds(model_name, page_size, max_blocks=max_blocks)
            if page_size is not None and page_size < block_size
            else None
        )
        self._live: weakref.WeakSet[Generation] = weakref.WeakSet()  # arrived, not yet recorded
        self._in_flight: weakref.WeakKeyDictionary[Generation, int] = weakref.WeakKeyDictionary()
        self._last_end: OrderedDict[int, float] = OrderedDict()  # session number -> ms it ended
        self._salt = secrets.token_bytes(16)
        self._sessions = Numbering(max_sessions)  # salted hash of (tenant, session) -> number
        started = datetime.now(UTC).isoformat(timespec="seconds")
        head = {TRACE_HEADER: HEADER_VERSION, "format": "mooncake", "block_size": block_size}
        if self._pages is not None:
            head["page_block_size"] = page_size
        self._write({**head, "order": "completion", "started_at": started, **header})

    @property
    def active(self) -> bool:
        return self._file is not None

    def _write(self, obj: Mapping[str, Any]) -> None:
        assert self._file is not None
        data = memoryview(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        done = 0
        try:
            while done < len(data):
                done += self._file.write(data[done:]) or 0
        except OSError:
            if done:  # a full disk took part of the line: leave only whole lines behind
                with contextlib.suppress(OSError, ValueError):
                    self._file.truncate(self._whole)
            raise
        self._whole += done

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as exc:
                self.error = self.error or f"{type(exc).__name__}: {exc}"

    def arrived(self, gen: Generation) -> None:
        """`gen` has arrived: it is in flight until its line is written (or it is dropped unrun).
        Holds weak references only, so a request that never ran is never counted for long."""
        if self._file is not None:
            self._in_flight[gen] = len(self._live)
            self._live.add(gen)

    def record(self, gen: Generation) -> None:
        """Append `gen`'s line; a write error ends the recording, never the request."""
        self._live.discard(gen)
        if self._file is None or gen.started < self.began or not gen.job.request.input_ids:
            return  # ended, or the request arrived before this recording began
        try:
            line = self.line(gen, time.monotonic())
            self._write(line)
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.error(
                "trace recording to %s stopped after %d requests: %s", self.path, self.requests, self.error
            )
            self.close()
            return
        self.requests += 1

    def line(self, gen: Generation, ended: float | None = None) -> dict[str, Any]:
        """`gen`'s line; `ended`: when it ended (time.monotonic(); now if not given)."""
        req = gen.job.request
        arrival = round((gen.started - self.began) * 1000.0, 3)
        finished = round(((time.monotonic() if ended is None else ended) - self.began) * 1000.0, 3)
        out: dict[str, Any] = {
            "timestamp": arrival,
            "input_length": len(req.input_ids),
            "output_length": len(gen.output_ids),
            "hash_ids": self._blocks.ids(req.input_ids, req.tenant),
        }
        if self._pages is not None:
            out["page_hash_ids"] = self._pages.ids(req.input_ids, req.tenant)
        out["finished"] = finished
        in_flight = self._in_flight.pop(gen, None)
        if in_flight is not None:
            out["in_flight"] = in_flight
        if req.session:
            number = self._sessions.number(self._session_key(req.tenant, req.session))
            out["session_id"] = number
            before = self._last_end.pop(number, None)
            if before is not None and before <= arrival:
                out["previous_finished"] = before
            self._last_end[number] = max(finished, before or 0.0)
            if len(self._last_end) > self._sessions.cap:
                self._last_end.popitem(last=False)
        if req.tenant is not None:
            out["tenant"] = hashlib.blake2b(req.tenant.encode(), key=self._salt, digest_size=8).hexdigest()
        out["cached_tokens"] = dict(gen.cached)
        if gen.prefill_cached_tokens is not None:
            out["prefill_cached_tokens"] = gen.prefill_cached_tokens
        if gen.transferred_tokens is not None:
            out["transferred_tokens"] = gen.transferred_tokens
        if gen.phases is not None:  # the front door's own wait first, then the decode node's parts
            out["phases"] = {"door_wait_s": round(gen.queued_s, 6), **gen.phases}
        out["ttft_s"] = None if gen.ttft_s is None else round(gen.ttft_s, 6)
        out["tpot_s"] = None if gen.tpot_s is None else round(gen.tpot_s, 6)
        out["finish_reason"] = gen.finish.reason if gen.finish is not None else None
        return out

    def _session_key(self, tenant: str | None, session: str) -> bytes:
        """16 bytes for a session of any length: the map never holds what a client sent."""
        h = hashlib.blake2b(key=self._salt, digest_size=16, person=b"hicache-session")
        for part in (
            b"" if tenant is None else b"\x01" + tenant.encode("utf-8", "surrogatepass"),
            session.encode("utf-8", "surrogatepass"),
        ):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()

    def status(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "recording": self.active,
            "requests": self.requests,
            "error": self.error,
        }


class TraceRecorder:
    """Whether, and where, the front door records: at most one `Recording` at a time, in files
    under `directory` (what the admin endpoints may name) or at the path given at start-up.
    `header` is the node's configuration, written at the top of every file; `block_size` the
    tokens per hash id (the page size, `page_size`, if not given: a replay then sees every shared
    page; a coarser one, e.g. Mooncake's 512, writes per-page ids alongside)."""

    def __init__(
        self,
        model_name: str,
        *,
        directory: Path | None = None,
        header: Mapping[str, Any] | None = None,
        block_size: int | None = None,
        page_size: int | None = None,
    ):
        self.model_name = model_name
        self.page_size = page_size
        self.block_size = block_size or page_size or MOONCAKE_BLOCK
        self.directory = directory
        self.header: dict[str, Any] = dict(header or {})
        self.current: Recording | None = None

    @property
    def active(self) -> Recording | None:
        """The recording a request arriving now belongs to (None: not recording)."""
        rec = self.current
        return rec if rec is not None and rec.active else None

    def resolve(self, name: str | None) -> Path:
        """The file an admin may name: under `directory`, ending in .jsonl; a fresh name if None."""
        if self.directory is None:
            raise RecordingError(
                "no directory allows recording: start the server with --record-trace-dir DIR"
            )
        if name is None:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
            name = f"trace-{stamp}-{secrets.token_hex(3)}.jsonl"
        if "\0" in name:  # the OS takes no NUL in a path: the caller's error, not the server's
            raise RecordingError(f"path {name!r}: a file name cannot hold a NUL character")
        root = self.directory.resolve()
        try:
            path = (root / name).resolve()
        except (OSError, ValueError) as exc:
            raise RecordingError(f"path {name!r}: not a usable file name ({exc})") from None
        if not path.is_relative_to(root) or path == root:
            raise RecordingError(f"path {name!r} is outside the recording directory {root}")
        if path.suffix != ".jsonl":
            raise RecordingError(f"path {name!r}: a Mooncake trace must end in .jsonl")
        return path

    def start(self, path: Path) -> Recording:
        """Start recording into a new file at `path` (`RecordingError` if one is running or the
        file cannot be made)."""
        if self.active is not None:
            raise RecordingError(f"already recording to {self.active.path}: stop it first", conflict=True)
        try:
            file = open_trace(path)
        except OSError as exc:
            why = f"{path}: cannot create the trace ({exc.strerror or exc})"
            raise RecordingError(why, conflict=isinstance(exc, FileExistsError)) from None
        try:
            rec = Recording(
                path, file, self.model_name, self.header, self.block_size, page_size=self.page_size
            )
        except OSError as exc:
            file.close()
            raise RecordingError(f"{path}: cannot write the trace's header ({exc.strerror or exc})") from None
        self.current = rec
        log.info("recording a trace to %s", path)
        return rec

    def stop(self) -> Recording | None:
        """Stop the recording (if any); returns it, for its status."""
        rec, self.current = self.current, None
        if rec is not None:
            rec.close()
            log.info("trace recording to %s stopped: %d requests", rec.path, rec.requests)
        return rec


def config_header(
    nodes: list[Mapping[str, Any] | None],
    *,
    prefill_nodes: int | None,
    router: str | None,
    prefill_cache_bytes: int | None = None,
) -> dict[str, Any]:
    """The header's account of the serving node: each decode node's answer to `config` (None
    where a node did not give one), summarised from the first; unknown values are null.
    `prefill_cache_bytes`: each prefill node's cache (its L1 of KV; 0: none), which decides what
    prefill computes again, when the front door knows it (it started the prefill nodes)."""
    first = nodes[0] if nodes and nodes[0] is not None else {}
    cfg = first.get("config") or {}
    layout = first.get("layout") or {}
    return {
        "model": first.get("model"),
        "geometry": {k: layout.get(k) for k in ("layers", "kv_heads", "head_dim", "dtype", "page_bytes")},
        "page_size": cfg.get("page_size"),
        "l1_pages": cfg.get("l1_pages"),
        "l2_pages": cfg.get("l2_pages"),
        "decode_config": cfg or None,
        "storage": first.get("storage"),
        "nodes": {"decode": len(nodes), "prefill": prefill_nodes, "router": router},
        "prefill_cache_bytes": prefill_cache_bytes,
        # The front door measures neither; a replay takes its own settings where these are null.
        "measured": {
            "link_bytes_per_s": None,
            "storage_read_bytes_per_s": None,
            "storage_write_bytes_per_s": None,
        },
        "decode_nodes": list(nodes),
    }
