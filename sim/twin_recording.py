"""The digital twin's input (`twin.py`): a trace recorded by `hicache serve --record-trace` read
and checked, its header (the node's configuration) and its requests (what the node served and
measured), in arrival order. A bad recording is a `TwinError` naming the file, line and field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from hicache.scenarios.traces import (
    TRACE_HEADER,
    TraceError,
    _block_ids,
    _int_field,
    _json,
    _num_field,
    _text,
)

HEADER_VERSION = 1  # the header version this twin reads
TIERS = ("l1", "l2", "l3")
LINE_KEYS = {
    "timestamp",
    "input_length",
    "output_length",
    "hash_ids",
    "page_hash_ids",
    "finished",
    "previous_finished",
    "in_flight",
    "session_id",
    "tenant",
    "cached_tokens",
    "prefill_cached_tokens",
    "transferred_tokens",
    "phases",
    "ttft_s",
    "tpot_s",
    "finish_reason",
}
# A line's `phases`: waits (the front door's, the decode node's, prefill's), then service.
PHASES = ("door_wait_s", "decode_wait_s", "prefill_wait_s", "prefill_compute_s", "transfer_s")
WAITS = ("door_wait_s", "decode_wait_s", "prefill_wait_s")
OVERLAP_SLACK_S = 0.02  # the rounding of a recorded end: TTFT + mean TPOT x (output - 1)


class TwinError(ValueError):
    """A recording the twin cannot replay; the message names the file, line and field."""


@attrs.frozen(slots=True)
class Recorded:
    """One request line: what the node served and what it measured."""

    id: str
    line: int
    arrival: float  # s from the recording's start
    input_length: int
    output_length: int
    block_ids: tuple[int, ...]
    session: str
    cached: tuple[int, int, int]  # tokens restored from L1, L2, L3
    prefill_cached: int | None
    transferred: int | None  # prompt tokens whose KV crossed P->D (None: not recorded)
    ttft_s: float | None
    tpot_s: float | None
    finish_reason: str | None
    finished: float | None = None  # s from the recording's start, when it ended (None: not recorded)
    previous_finished: float | None = None  # when its session's previous turn ended
    in_flight: int | None = None  # requests in flight when it arrived
    # Where its time to its KV went (seconds by `PHASES` name; empty: not recorded).
    phases: Mapping[str, float] = attrs.field(factory=dict, eq=False)

    @property
    def queued_s(self) -> float | None:
        """Seconds it waited (the front door, the decode node, then prefill), as recorded; None:
        not recorded."""
        if "decode_wait_s" not in self.phases:
            return None
        return sum(self.phases.get(k, 0.0) for k in WAITS)

    @property
    def answered(self) -> bool:
        return self.ttft_s is not None

    @property
    def e2e_s(self) -> float | None:
        if self.finished is not None:
            return max(0.0, self.finished - self.arrival)
        if self.ttft_s is None:
            return None
        return self.ttft_s + (self.tpot_s or 0.0) * max(0, self.output_length - 1)


@attrs.frozen(slots=True)
class Recording:
    path: Path
    header: dict[str, Any]
    block_size: int  # tokens per id of `Recorded.block_ids` (the per-page ids where recorded)
    requests: tuple[Recorded, ...]  # in arrival order

    @property
    def one_at_a_time(self) -> bool:
        """No two requests were in flight at once: each arrived after the one before had been
        answered (within `OVERLAP_SLACK_S`, the measured end being TTFT + TPOT x (output - 1))."""
        end = -math.inf
        for r in self.requests:
            if r.e2e_s is None or r.arrival < end - OVERLAP_SLACK_S:
                return False
            end = r.arrival + r.e2e_s
        return True


# ------------------------------------------------------------------------------ reading


def _optional_number(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    if obj.get(key) is None:
        return None
    return _num_field(dict(obj), key, where)


def _header(path: Path, raw: bytes | None) -> dict[str, Any]:
    where = f"{path}:1"
    if raw is None or not raw.strip():
        raise TwinError(f"{where}: empty file: expected a recorded trace's header line")
    obj = _json(_text(raw, where), where, "not a JSON object")
    if not isinstance(obj, dict) or TRACE_HEADER not in obj:
        raise TwinError(
            f"{where}: field {TRACE_HEADER!r} missing: not a trace recorded by `hicache serve "
            "--record-trace` (the twin needs the node's configuration in the header)"
        )
    version = obj[TRACE_HEADER]
    if version != HEADER_VERSION:
        raise TwinError(
            f"{where}: field {TRACE_HEADER!r}: version {version!r}, this twin reads {HEADER_VERSION}"
        )
    return obj


def _request(obj: Any, where: str, index: int, block: int, page_block: int | None) -> Recorded:
    if not isinstance(obj, dict):
        raise TwinError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - LINE_KEYS)
    if unknown:
        raise TwinError(
            f"{where}: field {unknown[0]!r}: unknown; expected one of {', '.join(sorted(LINE_KEYS))}"
        )
    ts = _num_field(obj, "timestamp", where)
    n_in = _int_field(obj, "input_length", where, low=1)
    n_out = _int_field(obj, "output_length", where)
    ids = _block_ids(obj, "hash_ids", where, n_in, block, partial_last=True)
    if page_block is not None:  # per-page ids beside coarser blocks: the ones hits are decided at
        ids = _block_ids(obj, "page_hash_ids", where, n_in, page_block, partial_last=True)
    in_flight = obj.get("in_flight")
    if in_flight is not None:
        in_flight = _int_field(obj, "in_flight", where, low=0)
    session = obj.get("session_id")
    if session is not None and (not isinstance(session, int) or isinstance(session, bool) or session < 0):
        raise TwinError(f"{where}: field 'session_id' must be an integer >= 0, got {session!r}")
    cached = obj.get("cached_tokens")
    if not isinstance(cached, dict) or set(cached) - set(TIERS):
        raise TwinError(f"{where}: field 'cached_tokens' must be an object of l1, l2, l3 token counts")
    tiers = tuple(
        _int_field(cached, t, f"{where}: cached_tokens", low=0) if t in cached else 0 for t in TIERS
    )
    if sum(tiers) > n_in:
        raise TwinError(f"{where}: field 'cached_tokens' sums to {sum(tiers)}, more than input_length {n_in}")
    prefill = obj.get("prefill_cached_tokens")
    if prefill is not None:
        prefill = _int_field(obj, "prefill_cached_tokens", where)
    transferred = obj.get("transferred_tokens")
    if transferred is not None:
        transferred = _int_field(obj, "transferred_tokens", where, low=0)
        if transferred > n_in:
            raise TwinError(
                f"{where}: field 'transferred_tokens' is {transferred}, more than input_length {n_in}"
            )
    phases = obj.get("phases")
    if phases is not None:
        if not isinstance(phases, dict) or set(phases) - set(PHASES):
            got = sorted(phases) if isinstance(phases, dict) else type(phases).__name__
            raise TwinError(
                f"{where}: field 'phases' must be an object of seconds named {', '.join(PHASES)}, got {got}"
            )
        phases = {k: _num_field(phases, k, f"{where}: field 'phases'") for k in PHASES if k in phases}
    finish = obj.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise TwinError(f"{where}: field 'finish_reason' must be a string or null, got {finish!r}")
    return Recorded(
        id=f"line{where.rsplit(':', 1)[1]}",
        line=index,
        arrival=ts / 1000.0,
        input_length=n_in,
        output_length=n_out,
        block_ids=ids,
        session="" if session is None else f"s{session}",
        cached=tiers,  # type: ignore[arg-type]
        prefill_cached=prefill,
        transferred=transferred,
        ttft_s=_optional_number(obj, "ttft_s", where),
        tpot_s=_optional_number(obj, "tpot_s", where),
        finish_reason=finish,
        finished=_ms(obj, "finished", where),
        previous_finished=_ms(obj, "previous_finished", where),
        in_flight=in_flight,
        phases=phases or {},
    )


def _ms(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    value = _optional_number(obj, key, where)
    return None if value is None else value / 1000.0


def read_recording(path: str | Path) -> Recording:
    """The header and every request of a recorded trace, sorted by arrival (lines are written in
    completion order); `TwinError` naming the file, line and field otherwise."""
    path = Path(path)
    try:
        f = path.open("rb")
    except OSError as exc:
        raise TwinError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    requests: list[Recorded] = []
    with f:
        header = _header(path, f.readline())
        block = header.get("block_size")
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise TwinError(f"{path}:1: field 'block_size' must be an integer >= 1, got {block!r}")
        page_block = header.get("page_block_size")
        if page_block is not None and (
            not isinstance(page_block, int) or isinstance(page_block, bool) or page_block < 1
        ):
            raise TwinError(f"{path}:1: field 'page_block_size' must be an integer >= 1, got {page_block!r}")
        try:
            for lineno, raw in enumerate(f, 2):
                where = f"{path}:{lineno}"
                text = _text(raw, where)
                if text.strip():
                    obj = _json(text, where, "not a JSON object")
                    requests.append(_request(obj, where, lineno, block, page_block))
        except TraceError as exc:
            raise TwinError(str(exc)) from None
    if not requests:
        raise TwinError(f"{path}: the recording holds no request")
    requests.sort(key=lambda r: (r.arrival, r.line))
    return Recording(path, header, page_block or block, tuple(requests))
