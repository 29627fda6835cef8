"""How long the core waits before retrying a failed prefill transfer.

A prefill node that restarts fails every transfer sent to it for a while; retries sent at once
fail too, so the whole restart window would fail every request. Retry k of a transfer
(k = 1 for the first) therefore waits `min(cap, base * 2**(k-1))`, exponential and capped, scaled
by a jitter factor in [0.5, 1) ("equal jitter": at least half the step, so retries still back
off, at most all of it). The jitter spreads the retries of many decode requests apart, so a
prefill that comes back is not hit by all of them at once.

The jitter is not random: it is a hash of (request id, retry number). Core decisions depend only
on the events fed in (no clock, no random source), so TP ranks, fed the same events, compute
the same delay and stay in lockstep, and a recorded run replays exactly.
"""

from __future__ import annotations

import hashlib


def jitter(req: str, attempt: int) -> float:
    """A factor in [0.5, 1), fixed by the request and the retry number, spread like a uniform
    draw: BLAKE2b of "req:attempt", its top 52 bits as a fraction of 2**53 added to 0.5 (every
    such sum is a float exactly, so the factor never rounds up to 1)."""
    digest = hashlib.blake2b(f"{req}:{attempt}".encode(), digest_size=8).digest()
    return 0.5 + (int.from_bytes(digest, "big") >> 12) / (1 << 53)


def retry_delay(base: float, cap: float, req: str, attempt: int) -> float:
    """Seconds before retry `attempt` (1 for the first retry) of request `req`'s transfer:
    `min(cap, base * 2**(attempt-1)) * jitter(req, attempt)`. Zero when `base` or `cap` is zero
    (retry at once)."""
    if attempt < 1:
        raise ValueError(f"retry_delay: attempt counts retries from 1, got {attempt!r}")
    if base <= 0 or cap <= 0:
        return 0.0
    step = base
    for _ in range(attempt - 1):  # doubling stops at the cap: no overflow for any attempt
        if step >= cap:
            break
        step *= 2
    return min(cap, step) * jitter(req, attempt)
