"""Store-back: a request's pages handed to the tree when it leaves the batch (finished or
retracted), which backs them up L1 -> L2 -> L3 by its write policy, and the ends of those copies."""

from __future__ import annotations

from hicache.core import events as ev
from hicache.core.decode_base import DecodeNodeBase
from hicache.core.request import Request


class DecodeStoreBack(DecodeNodeBase):
    """A request's KV into the tree, and the tree's copies' completions."""

    def _store_in_tree(self, r: Request, shed: int = 0, written: int | None = None) -> None:
        """Hand a request's full pages whose KV is written (of its first `written` tokens, by
        default all) to the tree, prompt and output; free the rest. With `shed`, up to that many
        of its own last pages are freed at once instead: pages handed to the tree may not be
        evictable yet (a backup in flight), and a retraction needs room now."""
        keep = len(r.slots) - min(shed, len(r.slots) - r.shared)
        written = r.seq_len if written is None else written
        full = min(written // self.cfg.page_size, keep) if self.cfg.radix else 0
        if full:
            self.tree.insert(r.keys[:full], r.slots[:full], r.owner, self.now, priority=r.priority)
        tail = r.slots[max(full, r.shared) :]
        if tail:
            self.device_pool.free(tail, r.owner)
        r.slots = []
        if r.lock is not None:
            self.tree.unlock(r.lock)
            r.lock = None
        self.reserved -= r.reserve
        r.reserve = 0

    def _on_backup_done(self, e: ev.BackupDone) -> None:
        self.tree.backup_done(e.op, e.failed)

    def _on_store_done(self, e: ev.StoreDone) -> None:
        self.tree.store_done(e.op, e.failed)
