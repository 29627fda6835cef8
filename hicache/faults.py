"""Fault injection shared by both drivers: which operations fail, how, and how often.

A `FaultSpec` names, per kind of operation a decode node performs, the faults to inject and
their rates. Whether one operation suffers a fault is decided by `decide`, a pure function of
(seed, operation kind, operation id, node, sub-index): hashing those, never a shared random
stream, so a decision does not depend on how many other decisions came before it, and two runs
of the same scenario inject the same faults into the same operations.

Operation kinds (`OPS`) and the faults that apply to each (`APPLIES`):

| op          | the operation                     | faults                                    |
|-------------|-----------------------------------|-------------------------------------------|
| `l3_exists` | L3 existence query                | error, delay, partial                     |
| `l3_get`    | L3 -> L2 read (a prefetch)        | error, delay, partial, corrupt            |
| `l3_put`    | L2 -> L3 write (a store)          | error, delay, partial, corrupt            |
| `load`      | L2 -> L1 copy (a load-back)       | error, delay, partial, corrupt            |
| `backup`    | L1 -> L2 copy                     | error, delay, partial, corrupt            |
| `transfer`  | the KV increment, prefill -> decode | error, delay, partial, corrupt, peer_death |
| `timer`     | a prefetch deadline, a retry backoff | error (fires at once), delay (fires late) |

What each fault does to each operation is the drivers' part (`hicache.sim.faults`,
`hicache.runtime.decode.faults`); the table in docs/reliability.md states it. This module is pure data
and arithmetic: both drivers import it.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import attrs

OPS = ("l3_exists", "l3_get", "l3_put", "load", "backup", "transfer", "timer")
FAULT_KINDS = ("error", "delay", "partial", "corrupt", "peer_death")
APPLIES: dict[str, tuple[str, ...]] = {
    "l3_exists": ("error", "delay", "partial"),
    "l3_get": ("error", "delay", "partial", "corrupt"),
    "l3_put": ("error", "delay", "partial", "corrupt"),
    "load": ("error", "delay", "partial", "corrupt"),
    "backup": ("error", "delay", "partial", "corrupt"),
    "transfer": ("error", "delay", "partial", "corrupt", "peer_death"),
    "timer": ("error", "delay"),
}
SPEC_KEYS = ("seed", *OPS)
_FAULT_KEYS = ("kind", "rate", "seconds")


class FaultSpecError(ValueError):
    """A fault specification that cannot be used: the dotted `field` (e.g. `faults.load.rate`)
    and `detail`, which names the bad value and what was expected."""

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        self.detail = detail
        super().__init__(f"{field}: {detail}")


def _repr(value: Any) -> str:
    """`repr`, shortened (a hostile file may hold an int of thousands of digits)."""
    try:
        text = repr(value)
    except ValueError:  # beyond the int-to-str digit limit
        text = f"<an int of {value.bit_length()} bits>"
    return text if len(text) <= 60 else text[:57] + "..."


def _show(value: Any) -> str:
    return f"{_repr(value)} ({type(value).__name__})"


def _number(value: Any, field: str, what: str) -> float:
    try:
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int beyond any float
        number = math.inf
    if not math.isfinite(number):
        raise FaultSpecError(field, f"expected {what}, got {_show(value)}")
    return number


@attrs.frozen(slots=True)
class Fault:
    """One fault for one kind of operation: `kind` happens to a share `rate` of operations.
    `seconds` is the range [lo, hi] a `delay` draws from (lo == hi: a fixed delay)."""

    kind: str
    rate: float
    seconds: tuple[float, float] = (0.0, 0.0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "rate": self.rate}
        if self.kind == "delay":
            lo, hi = self.seconds
            out["seconds"] = lo if lo == hi else [lo, hi]
        return out


def _parse_fault(op: str, data: Any, field: str) -> Fault:
    if not isinstance(data, Mapping):
        raise FaultSpecError(field, f"expected a table {{ kind = ..., rate = ... }}, got {_show(data)}")
    for key in data:
        if key not in _FAULT_KEYS:
            raise FaultSpecError(f"{field}.{key}", f"unknown key; expected one of: {', '.join(_FAULT_KEYS)}")
    if "kind" not in data:
        raise FaultSpecError(f"{field}.kind", f"required: one of {', '.join(APPLIES[op])}")
    kind = data["kind"]
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        raise FaultSpecError(
            f"{field}.kind", f"unknown fault {_show(kind)}; expected one of: {', '.join(FAULT_KINDS)}"
        )
    if kind not in APPLIES[op]:
        raise FaultSpecError(
            f"{field}.kind", f"{kind!r} does not apply to {op}; expected one of: {', '.join(APPLIES[op])}"
        )
    if "rate" not in data:
        raise FaultSpecError(f"{field}.rate", "required: a probability in [0, 1] per operation")
    rate = _number(data["rate"], f"{field}.rate", "a probability in [0, 1]")
    if not 0.0 <= rate <= 1.0:
        raise FaultSpecError(f"{field}.rate", f"expected a probability in [0, 1], got {_repr(data['rate'])}")
    seconds = (0.0, 0.0)
    if kind == "delay":
        if "seconds" not in data:
            raise FaultSpecError(f"{field}.seconds", "required for a delay: seconds, or [lo, hi] seconds")
        raw = data["seconds"]
        what = "seconds >= 0, or a range [lo, hi] with 0 <= lo <= hi"
        if isinstance(raw, list | tuple):
            if len(raw) != 2:
                raise FaultSpecError(f"{field}.seconds", f"expected {what}, got {_show(raw)}")
            lo = _number(raw[0], f"{field}.seconds", what)
            hi = _number(raw[1], f"{field}.seconds", what)
        else:
            lo = hi = _number(raw, f"{field}.seconds", what)
        if not 0.0 <= lo <= hi:
            raise FaultSpecError(f"{field}.seconds", f"expected {what}, got {_repr(raw)}")
        seconds = (lo, hi)
    elif "seconds" in data:
        raise FaultSpecError(f"{field}.seconds", f"only a delay takes seconds, this fault is {kind!r}")
    return Fault(kind, rate, seconds)


@attrs.frozen(slots=True)
class FaultSpec:
    """The faults to inject, per operation kind, and the seed of every decision.

    An operation kind takes one fault or several; with several, one draw picks at most one of
    them (their rates are disjoint shares of operations, so they may add up to at most 1).
    """

    seed: int = 0
    ops: tuple[tuple[str, tuple[Fault, ...]], ...] = ()

    def faults(self, op: str) -> tuple[Fault, ...]:
        for name, faults in self.ops:
            if name == op:
                return faults
        return ()

    @property
    def active(self) -> bool:
        """Whether any fault can happen at all."""
        return any(f.rate > 0 for _, faults in self.ops for f in faults)

    @classmethod
    def parse(cls, data: Any, field: str = "faults") -> FaultSpec:
        """A spec from plain data (a TOML `[faults]` table or JSON); errors name `field.key`."""
        if not isinstance(data, Mapping):
            raise FaultSpecError(field, f"expected a table of operation kinds, got {_show(data)}")
        seed = data.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise FaultSpecError(f"{field}.seed", f"expected an integer in [0, 2**64), got {_show(seed)}")
        ops = []
        for op, value in data.items():
            if op == "seed":
                continue
            if op not in OPS:
                raise FaultSpecError(
                    f"{field}.{op}", f"unknown operation kind; expected one of: {', '.join(SPEC_KEYS)}"
                )
            if isinstance(value, list | tuple):
                if not value:
                    raise FaultSpecError(f"{field}.{op}", "expected at least one fault, got an empty array")
                faults = tuple(_parse_fault(op, v, f"{field}.{op}[{i}]") for i, v in enumerate(value))
            else:
                faults = (_parse_fault(op, value, f"{field}.{op}"),)
            total = sum(f.rate for f in faults)
            if total > 1.0 + 1e-12:
                raise FaultSpecError(
                    f"{field}.{op}", f"the rates add up to {total:g}; a share of operations is at most 1"
                )
            ops.append((op, faults))
        ops.sort(key=lambda item: OPS.index(item[0]))
        return cls(seed, tuple(ops))

    def to_dict(self) -> dict[str, Any]:
        """Plain data that `parse` turns back into this spec."""
        out: dict[str, Any] = {"seed": self.seed}
        for op, faults in self.ops:
            out[op] = faults[0].to_dict() if len(faults) == 1 else [f.to_dict() for f in faults]
        return out

    def to_arg(self) -> str:
        """The spec as one JSON line (what `hicache node decode --faults` takes)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_arg(cls, text: str) -> FaultSpec:
        """A spec from a command-line value: a JSON object, or a comma-separated list of
        `OP:KIND:RATE` items (a delay adds `:SECONDS` or `:LO..HI`) and an optional `seed:N`,
        e.g. `l3_get:error:0.01,load:delay:0.1:0.001..0.05,seed:7`."""
        text = text.strip()
        if text.startswith("{"):
            try:
                doc = json.loads(text)
            except json.JSONDecodeError as exc:
                raise FaultSpecError("--faults", f"invalid JSON ({exc})") from None
            return cls.parse(doc, "--faults")
        data: dict[str, Any] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            parts = item.split(":")
            if parts[0] == "seed" and len(parts) == 2:
                try:
                    data["seed"] = int(parts[1])
                except ValueError:
                    raise FaultSpecError("--faults.seed", f"expected an integer, got {parts[1]!r}") from None
                continue
            if len(parts) not in (3, 4):
                raise FaultSpecError(
                    "--faults", f"{item!r}: expected OP:KIND:RATE or OP:delay:RATE:SECONDS (or seed:N)"
                )
            op, kind, rate = parts[:3]
            try:
                entry: dict[str, Any] = {"kind": kind, "rate": float(rate)}
                if len(parts) == 4:
                    lo, _, hi = parts[3].partition("..")
                    entry["seconds"] = [float(lo), float(hi)] if hi else float(lo)
            except ValueError:
                raise FaultSpecError(
                    f"--faults.{op}", f"{item!r}: RATE and SECONDS must be numbers"
                ) from None
            previous = data.get(op)
            if previous is None:
                data[op] = entry
            else:
                data[op] = [*(previous if isinstance(previous, list) else [previous]), entry]
        return cls.parse(data, "--faults")


@attrs.frozen(slots=True)
class Decision:
    """The fault one operation suffers. `delay` is in seconds (for a `delay`); `fraction` in
    [0, 1) places a `partial`'s cut, a `corrupt` page or a `peer_death` within the operation."""

    op: str
    kind: str
    delay: float = 0.0
    fraction: float = 0.0

    def prefix(self, n: int) -> int:
        """How many of `n` items complete under a `partial`: strictly fewer than n (n >= 1)."""
        return min(int(self.fraction * n), max(n - 1, 0))

    def index(self, n: int) -> int:
        """Which of `n` items (n >= 1) a `corrupt` hits."""
        return min(int(self.fraction * n), n - 1)


def uniforms(seed: int, op: str, op_id: int, node: int = 0, sub: int = 0) -> tuple[float, float, float]:
    """Three independent uniforms in [0, 1), a pure function of the arguments."""
    key = struct.pack("<QqqQ", seed, int(op_id), int(node), int(sub)) + op.encode()
    digest = hashlib.blake2b(key, digest_size=24).digest()
    words = struct.unpack("<3Q", digest)
    return tuple((w >> 11) * 2.0**-53 for w in words)  # type: ignore[return-value]


def decide(spec: FaultSpec, op: str, op_id: int, *, node: int = 0, sub: int = 0) -> Decision | None:
    """The fault operation `op_id` of kind `op` suffers on decode node `node`, or None.
    `sub` tells apart parts of one operation that draw separately (the requests of one L3 query)."""
    faults = spec.faults(op)
    if not faults:
        return None
    u_pick, u_delay, u_where = uniforms(spec.seed, op, op_id, node, sub)
    edge = 0.0
    for f in faults:
        edge += f.rate
        if u_pick < edge:
            lo, hi = f.seconds
            return Decision(op, f.kind, lo + (hi - lo) * u_delay if f.kind == "delay" else 0.0, u_where)
    return None
