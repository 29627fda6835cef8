"""Digests of KV pages: how the runtime proves that restoring copies bytes and never alters
them. A digest names a page's exact bytes (16-byte BLAKE2b), so equal digests mean bit-identical
KV; they travel in control messages instead of the pages themselves."""

from __future__ import annotations

import hashlib

import torch


def page_digest(page: torch.Tensor) -> str:
    """The hex digest of one page's bytes (any dtype, any device)."""
    data = page.detach().contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


def page_digests(pages: torch.Tensor) -> list[str]:
    """Digests of each page along the first dimension."""
    return [page_digest(p) for p in pages]
