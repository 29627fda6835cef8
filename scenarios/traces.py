"""Readers for real LLM-serving traces, with errors that name the file, line and field.

- Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`: one chained id
  per 512-token block, the last block possibly partial);
- Azure LLM inference CSV (`TIMESTAMP`, `ContextTokens`, `GeneratedTokens`; no prefix data);
- kv-cache-tester JSON (one coding-agent session per file: `t` s, `in`, `out`, `hash_ids` in
  64-token blocks local to the file, sub-agents nesting their own `requests` with `t` relative
  to the sub-agent's start).

A reader returns every request or raises `TraceError`: nothing is half-read.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import attrs

MOONCAKE_BLOCK = 512
TRACE_HEADER = "hicache_trace_header"  # the key of a recorded trace's first line
# kv-cache-tester ids are local to their file: give each file its own id range.
_SESSION_ID_STRIDE = 1 << 40


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file, line and field."""


@attrs.frozen(slots=True)
class TraceRequest:
    """One request of a trace: arrival in seconds from the trace's start."""

    arrival: float
    input_length: int
    output_length: int
    block_ids: tuple[int, ...] | None = None  # chained ids, one per `block_size` input tokens
    block_size: int | None = None
    session: str | None = None


MAX_TOKENS = 1 << 31  # no real prompt or output comes near this; larger values are corrupt


def _int_field(obj: dict[str, Any], key: str, where: str, *, low: int = 0) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < MAX_TOKENS:
        raise TraceError(
            f"{where}: field {key!r} must be an integer in {low}..{MAX_TOKENS - 1}, got {value!r}"
        )
    return value


def _num_field(obj: dict[str, Any], key: str, where: str) -> float:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: field {key!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def _block_ids(
    obj: dict[str, Any], key: str, where: str, input_length: int, block: int, *, partial_last: bool
) -> tuple[int, ...]:
    """The block ids of a request: one per full block, plus one for a partial last block when
    the format ids it (Mooncake does, kv-cache-tester does not)."""
    ids = obj.get(key)
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceError(f"{where}: field {key!r} must be a list of integers")
    if any(i < 0 or i >= _SESSION_ID_STRIDE for i in ids):
        raise TraceError(f"{where}: field {key!r} holds an id outside 0..2^40-1")
    want = math.ceil(input_length / block) if partial_last else input_length // block
    if len(ids) != want:
        rule = "ceil" if partial_last else "floor"
        raise TraceError(
            f"{where}: field {key!r} has {len(ids)} ids, expected {rule}(input_length / {block}) = {want}"
        )
    return tuple(ids)


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{where}: not UTF-8 text (byte {exc.start})") from None


def _json(text: str, where: str, what: str) -> Any:
    """Parsed JSON; a number of too many digits or nesting too deep is refused like bad syntax."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: {what} ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"{where}: {what} ({exc})") from None


def read_mooncake(path: str | Path, *, time_scale: float = 1.0) -> list[TraceRequest]:
    """A Mooncake JSONL trace; arrival times are multiplied by `time_scale`."""
    return list(iter_mooncake(path, time_scale=time_scale))


def iter_mooncake(path: str | Path, *, time_scale: float = 1.0) -> Iterator[TraceRequest]:
    """A Mooncake JSONL trace, one request at a time, in file order: a replay of a long trace
    then holds only the requests in flight. A bad line raises `TraceError` when it is reached."""
    path = Path(path)
    if not time_scale > 0:
        raise TraceError(f"time_scale must be > 0, got {time_scale!r}")
    block = MOONCAKE_BLOCK
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            line = _text(raw, where)
            if not line.strip():
                continue
            obj = _json(line, where, "not a JSON object")
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if lineno == 1 and TRACE_HEADER in obj:  # a recorded trace's header (`read_trace_header`)
                block = _int_field(obj, "block_size", where, low=1) if "block_size" in obj else block
                continue
            ts = _num_field(obj, "timestamp", where)
            n_in = _int_field(obj, "input_length", where, low=1)
            n_out = _int_field(obj, "output_length", where)
            ids = _block_ids(obj, "hash_ids", where, n_in, block, partial_last=True)
            yield TraceRequest(ts / 1000.0 * time_scale, n_in, n_out, ids, block)


def read_trace_header(path: str | Path) -> dict[str, Any] | None:
    """The header of a Mooncake trace recorded by `hicache serve --record-trace` (its first line,
    the serving node's configuration), or None when the file has none."""
    path = Path(path)
    with path.open("rb") as f:
        first = f.readline()
    where = f"{path}:1"
    obj = _json(_text(first, where), where, "not a JSON object") if first.strip() else None
    return obj if isinstance(obj, dict) and TRACE_HEADER in obj else None


def read_azure_csv(path: str | Path, *, time_scale: float = 1.0) -> list[TraceRequest]:
    """An Azure LLM inference CSV trace (lengths and arrivals only)."""
    path = Path(path)
    out: list[TraceRequest] = []
    start: datetime | None = None
    with path.open("rb") as f:
        reader = csv.DictReader(_utf8_lines(f, path))
        needed = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        try:
            fields = reader.fieldnames
        except csv.Error as exc:
            raise TraceError(f"{path}:1: not a CSV header ({exc})") from None
        if fields is None or not needed <= set(fields):
            raise TraceError(f"{path}:1: expected the columns {sorted(needed)}, got {fields}")
        for lineno, row in enumerate(_csv_rows(reader, path), 2):
            where = f"{path}:{lineno}"
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
            except (ValueError, AttributeError):
                raise TraceError(
                    f"{where}: field 'TIMESTAMP' is not a date-time: {row['TIMESTAMP']!r}"
                ) from None
            values = {}
            for key in ("ContextTokens", "GeneratedTokens"):
                try:
                    values[key] = int(row[key])
                except (TypeError, ValueError):
                    raise TraceError(f"{where}: field {key!r} must be an integer, got {row[key]!r}") from None
                if not (1 if key == "ContextTokens" else 0) <= values[key] < MAX_TOKENS:
                    raise TraceError(f"{where}: field {key!r} out of range: {values[key]}")
            start = ts if start is None else start
            if (ts.tzinfo is None) != (start.tzinfo is None):
                raise TraceError(f"{where}: field 'TIMESTAMP' mixes times with and without a UTC offset")
            arrival = (ts - start).total_seconds() * time_scale
            out.append(TraceRequest(arrival, values["ContextTokens"], values["GeneratedTokens"]))
    out.sort(key=lambda r: r.arrival)
    return out


def _utf8_lines(f: BinaryIO, path: Path) -> Iterator[str]:
    """A binary file's lines as text, so bytes that are not UTF-8 are blamed on their line."""
    for lineno, raw in enumerate(f, 1):
        yield _text(raw, f"{path}:{lineno}")


def _csv_rows(reader: csv.DictReader, path: Path) -> Iterator[dict[str, Any]]:
    """The reader's rows; a row the csv module refuses (a field over its size limit) is a
    `TraceError` naming its line."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TraceError(f"{path}:{reader.reader.line_num}: not a CSV row ({exc})") from None
        yield row


def read_kv_cache_tester(path: str | Path) -> list[TraceRequest]:
    """kv-cache-tester sessions: one JSON file, or every `*.json` in a directory (sorted by name,
    each its own session and id space). Sub-agent requests are placed at their absolute time."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise TraceError(f"{path}: no *.json session files")
    out: list[TraceRequest] = []
    for index, file in enumerate(files):
        try:
            doc = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{file}:{exc.lineno}: not JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:  # not UTF-8, a number too long, nested too deep
            raise TraceError(f"{file}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
            raise TraceError(f"{file}: expected an object with a 'requests' list")
        block = _int_field(doc, "block_size", str(file), low=1)
        session = str(doc.get("id", file.stem))
        try:
            _walk_session(doc["requests"], file, "requests", 0.0, block, index, session, out)
        except RecursionError:
            raise TraceError(f"{file}: sub-agents nested too deeply") from None
    out.sort(key=lambda r: r.arrival)
    return out


def _walk_session(
    requests: list[Any],
    file: Path,
    where: str,
    offset: float,
    block: int,
    index: int,
    session: str,
    out: list[TraceRequest],
) -> None:
    for i, req in enumerate(requests):
        here = f"{file}: {where}[{i}]"
        if not isinstance(req, dict):
            raise TraceError(f"{here}: expected an object")
        t = offset + _num_field(req, "t", here)
        if req.get("type") == "subagent":
            sub = req.get("requests")
            if not isinstance(sub, list):
                raise TraceError(f"{here}: a subagent needs a 'requests' list")
            _walk_session(sub, file, f"{where}[{i}].requests", t, block, index, session, out)
            continue
        n_in = _int_field(req, "in", here, low=1)
        n_out = _int_field(req, "out", here)
        ids = _block_ids(req, "hash_ids", here, n_in, block, partial_last=False)
        base = index * _SESSION_ID_STRIDE
        out.append(TraceRequest(t, n_in, n_out, tuple(base + x for x in ids), block, session))


def read_trace(path: str | Path, *, time_scale: float = 1.0) -> list[TraceRequest]:
    """Read any supported trace, chosen by its suffix (a directory is kv-cache-tester)."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory")
    if path.is_dir() or path.suffix == ".json":
        return read_kv_cache_tester(path)
    if path.suffix == ".jsonl":
        return read_mooncake(path, time_scale=time_scale)
    if path.suffix == ".csv":
        return read_azure_csv(path, time_scale=time_scale)
    raise TraceError(f"{path}: unknown trace format; expected .jsonl (Mooncake), .csv (Azure) or .json/dir")
