"""When a prefetch stops: the prefetch policies' rule as one named function.

The rule sees only agreed facts (with several TP ranks, progress is the minimum over ranks and
`ended` means every rank's copy ended), so every rank stops the same prefetch at the same tick.
"""

from __future__ import annotations

from hicache.core.config import PrefetchPolicy


def prefetch_should_stop(
    policy: PrefetchPolicy,
    *,
    progress: int,
    planned: int,
    ended: bool,
    timed_out: bool,
    schedulable: bool,
) -> bool:
    """Whether to fix a prefetch's usable length now, at `progress` of `planned` pages.

    Every policy stops once the prefetch ended or fetched everything. Beyond that, `timeout`
    stops once its timer fired, and `best_effort` as soon as the request could be scheduled
    without it (`schedulable`: its transfer from prefill has arrived); `wait_complete` waits."""
    if ended or progress >= planned:
        return True
    if policy is PrefetchPolicy.TIMEOUT:
        return timed_out
    if policy is PrefetchPolicy.BEST_EFFORT:
        return schedulable
    return False
