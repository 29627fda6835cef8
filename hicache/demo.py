"""A minimal driver that replays a workload through one decode node's tiered tree.

It shows the core at work without a cost model: every prompt is matched against L1 and L2,
the request's KV is placed on L1 (evicting by policy), its pages are inserted after it
finishes, and backups complete at once. It counts where each prompt token came from.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import numpy as np

from hicache.core.commands import Backup
from hicache.core.pages import namespace_seed, page_keys
from hicache.core.pool import SlotPool
from hicache.core.tree import TieredRadixTree
from hicache.scenarios.multiturn import ChatRequest


@attrs.define
class DemoReport:
    """Where the prompt tokens of a replay came from, and what the tree did."""

    label: str
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    l1_tokens: int = 0
    l2_tokens: int = 0
    demoted_pages: int = 0
    dropped_pages: int = 0
    host_evicted_pages: int = 0
    backed_up_pages: int = 0

    @property
    def missed_tokens(self) -> int:
        return self.prompt_tokens - self.l1_tokens - self.l2_tokens

    def ratio(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay(
    requests: Iterable[ChatRequest],
    *,
    label: str,
    page_size: int,
    l1_pages: int,
    l2_pages: int,
    eviction: str = "lru",
    write_policy: str = "write_through",
    model: str = "demo-model",
) -> DemoReport:
    """Replay `requests` in arrival order through a tree with the given tier sizes."""
    tree = TieredRadixTree(
        SlotPool("L1", l1_pages), SlotPool("L2", l2_pages), eviction=eviction, write_policy=write_policy
    )
    seed = namespace_seed(model)
    report = DemoReport(label)

    def finish_backups() -> None:
        for cmd in tree.drain():
            if isinstance(cmd, Backup):
                tree.backup_done(cmd.op)

    for i, req in enumerate(requests):
        report.requests += 1
        report.prompt_tokens += len(req.prompt)
        sequence = np.concatenate([req.prompt, req.output])
        keys = page_keys(sequence, page_size, seed).tolist()
        prompt_pages = len(req.prompt) // page_size
        match = tree.match(keys[:prompt_pages], req.arrival)
        finish_backups()
        report.l1_tokens += match.device_pages * page_size
        report.l2_tokens += match.host_pages * page_size
        # The L1 prefix stays where it is (locked while we make room); everything after it —
        # loaded back from L2, or computed — needs fresh L1 pages.
        lock = tree.lock(match.device_node)
        owner = ("request", i)
        need = len(keys) - match.device_pages
        slots = tree.device_pool.alloc(need, owner)
        if slots is None:
            tree.evict_device(need - tree.device_pool.num_free)
            finish_backups()
            slots = tree.device_pool.alloc(need, owner)
        tree.unlock(lock)
        if slots is None:
            report.rejected += 1
            continue
        tree.insert(keys, match.device_slots + slots, owner, req.arrival)
        finish_backups()
    stats = tree.stats
    report.demoted_pages = stats.demoted
    report.dropped_pages = stats.dropped
    report.host_evicted_pages = stats.host_evicted
    report.backed_up_pages = stats.backed_up
    tree.check()
    return report
