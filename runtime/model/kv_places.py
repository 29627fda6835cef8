"""Where a forward finds the K/V of earlier positions and puts the new ones: one sequence's
contiguous past (`ContiguousKV`), or many sequences' pages of a KV pool (`PagedKV`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hicache.runtime.model.attention import attend, attend_last


class ContiguousKV:
    """One sequence: its past K/V in one tensor; the new tokens' K/V collected into `kv_new`.
    `first_row` is the first new row whose logits are wanted (the rows that query at the last
    layer run from it to the end), given as a host int so no layer reads it back from a GPU."""

    def __init__(
        self, past_kv: torch.Tensor | None, past_len: int, kv_new: torch.Tensor, first_row: int
    ) -> None:
        self.past_kv, self.past_len, self.kv_new = past_kv, past_len, kv_new
        self.first_row = first_row

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv_new[layer, 0] = k
        self.kv_new[layer, 1] = v

    def attend(self, layer: int, q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        k, v = self.kv_new[layer, 0], self.kv_new[layer, 1]
        if self.past_kv is not None and self.past_len > 0:
            k = torch.cat((self.past_kv[layer, 0], k), dim=0)
            v = torch.cat((self.past_kv[layer, 1], v), dim=0)
        # `rows`: the new rows that query, a run that ends at the last one (the last alone, or
        # every row whose logits are wanted); None: every new row.
        queries_from = self.past_len + (self.first_row if rows is not None else 0)
        return attend(q, k.to(q.dtype), v.to(q.dtype), queries_from)


class PagedKV:
    """Many sequences whose K/V lives in a pool's pages; new tokens' K/V is written there first.

    Request b has `counts[b]` new rows (consecutive in the flat batch) at positions
    `starts[b] ..`; its keys are gathered from the first pages of its page table, padded to the
    longest request, and masked causally, so padding never contributes. Slots past a request's
    positions are read (then masked), so they must hold finite values: a `KVPool` starts zeroed,
    and a reused page holds old, finite K/V.
    """

    def __init__(
        self,
        pool: torch.Tensor,
        page_tables: Sequence[Sequence[int]],
        starts: Sequence[int],
        counts: Sequence[int],
    ) -> None:
        # The indices are built on the host (from host ints) and moved to the pool's device once
        # per forward, not once per layer.
        dev = pool.device
        page_size = pool.shape[3]
        self.pool = pool
        self.batch = len(counts)
        self.ends = [s + n for s, n in zip(starts, counts, strict=True)]  # keys 0 .. end-1
        positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, self.ends, strict=True)])
        self.positions = positions  # on the host: RoPE's angles are computed there
        self.ends_tensor = torch.tensor(self.ends, dtype=torch.int64).to(dev, non_blocking=True)
        write_pages = torch.tensor(
            [
                page_tables[b][p // page_size]
                for b in range(self.batch)
                for p in range(starts[b], self.ends[b])
            ],
            dtype=torch.int64,
        )
        self.write_pages = write_pages.to(dev, non_blocking=True)
        self.write_slots = (positions % page_size).to(dev, non_blocking=True)
        need = [-(-e // page_size) for e in self.ends]
        width = max(need)
        # Padding entries repeat a page the request owns: always a valid index, and masked out.
        gather = torch.tensor(
            [
                list(page_tables[b][: need[b]]) + [page_tables[b][0]] * (width - need[b])
                for b in range(self.batch)
            ],
            dtype=torch.int64,
        )
        self.key_len = width * page_size
        # The pool as rows of one page's K (or V) for one layer: row (page * layers + layer) * 2 + kv.
        layers = pool.shape[1]
        self.rows_view = pool.view(pool.shape[0] * layers * 2, -1)
        base = gather * (layers * 2)
        self.page_rows = torch.stack((base, base + 1)).to(dev, non_blocking=True)  # (2, B, width)
        self.single_rows = all(n == 1 for n in counts)
        offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
        self.offsets = offsets  # on the host: `last_rows` is moved by the forward with the tokens
        self.max_rows = max(counts)
        if not self.single_rows and self.batch > 1:
            # Row r of the flat batch sits at (request, index within the request) in a padded grid.
            grid_b = torch.repeat_interleave(torch.arange(self.batch), torch.tensor(list(counts)))
            grid_i = torch.arange(int(offsets[-1])) - offsets[:-1][grid_b]
            # Each grid row's query position; padding rows repeat their request's last position.
            q_pos = torch.tensor(self.ends)[:, None] - 1 + torch.zeros(1, self.max_rows, dtype=torch.int64)
            q_pos[grid_b, grid_i] = positions
            key_pos = torch.arange(self.key_len)
            mask = key_pos[None, None, None, :] <= q_pos[:, None, :, None]  # (B, 1, rows, L)
            self.grid_b, self.grid_i = grid_b.to(dev, non_blocking=True), grid_i.to(dev, non_blocking=True)
            self.mask = mask.to(dev, non_blocking=True)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        dtype = self.pool.dtype
        self.pool[self.write_pages, layer, 0, self.write_slots] = k.to(dtype)
        self.pool[self.write_pages, layer, 1, self.write_slots] = v.to(dtype)

    def last_rows(self) -> torch.Tensor:
        """Flat indices of each request's last new row: only those need logits."""
        return self.offsets[1:] - 1

    def attend(self, layer: int, q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        b, heads, dim = self.batch, self.pool.shape[-2], self.pool.shape[-1]
        # One gather of whole contiguous rows (a page's K or V for one layer) into (2, B, L, ...).
        which = (self.page_rows + 2 * layer).view(-1)
        kv = torch.index_select(self.rows_view, 0, which).view(2, b, self.key_len, heads, dim)
        k, v = kv[0].to(q.dtype), kv[1].to(q.dtype)  # the pool's K/V dtype may differ from the model's
        if b == 1:
            # One sequence: exactly its keys, and the same attention call as the contiguous path.
            end = self.ends[0]
            return attend(q, k[0, :end], v[0, :end], end - q.shape[0])
        if rows is not None or self.single_rows:
            # One query per request: its last new position sees every key up to it.
            return attend_last(q, k, v, self.ends_tensor)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, kv_heads, L, head_dim)
        grid = q.new_zeros((b, self.max_rows, *q.shape[1:]))
        grid[self.grid_b, self.grid_i] = q
        out = F.scaled_dot_product_attention(grid.transpose(1, 2), k, v, attn_mask=self.mask, enable_gqa=True)
        return out.transpose(1, 2)[self.grid_b, self.grid_i].reshape(q.shape[0], -1)
