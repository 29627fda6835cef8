"""One tier's KV pages as a single preallocated torch tensor.

The core hands out page indices ("slots"); a pool maps a slot to its page of memory. All pages
live in one tensor so a batch of pages moves with one gather/scatter. A pool whose first writes
are on a request's critical path (the decode node's L1: restores and transfers land there) is
touched once at start-up: first-touch page faults cost ~15x a warm copy, so they must not land
on the first restore. A pool written only off that path, or by work that costs far more than the
faults (L2, filled by backups; prefill's pools, filled by the forward), can be `lazy`: anonymous
memory the kernel hands out zeroed page by page as it is first written, so the process holds
only what the tier uses (its RSS grows to the pool's size as the tier fills).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from hicache.runtime.kv.kv_layout import KVLayout

PageIndices = Sequence[int] | np.ndarray | torch.Tensor


def _device(value: str | torch.device) -> torch.device:
    device = torch.device(value)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"KVPool.device: expected 'cpu' or 'cuda', got {value!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"KVPool.device: {value!r} asked for, but torch sees no CUDA device")
    if device.type == "cuda" and device.index is None:  # name the GPU, so pools on it compare equal
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@attrs.define(eq=False, init=False)
class KVPool:
    """`num_pages` pages of `layout`, shape `(num_pages, *layout.page_shape)`.

    `pinned=None` pins a host pool exactly when a GPU is present (host-to-device copies from
    pageable memory go through a bounce buffer and cannot overlap; without CUDA, torch refuses to
    pin at all).
    """

    layout: KVLayout
    num_pages: int
    device: torch.device
    pinned: bool
    name: str
    data: torch.Tensor = attrs.field(repr=False)
    _bytes: torch.Tensor = attrs.field(repr=False)
    _words: torch.Tensor = attrs.field(repr=False)
    _mapping: mmap.mmap | None = attrs.field(repr=False)  # a lazy pool's memory, kept alive here

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        *,
        device: str | torch.device = "cpu",
        pinned: bool | None = None,
        name: str = "",
        lazy: bool = False,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"KVPool.layout: expected a KVLayout, got {type(layout).__name__}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"KVPool.num_pages: expected a positive int, got {num_pages!r}")
        dev = _device(device)
        if pinned is None:
            pinned = dev.type == "cpu" and torch.cuda.is_available()
        if pinned and dev.type != "cpu":
            raise ValueError(f"KVPool.pinned: only host pools can be pinned, this one is on {dev}")
        if pinned and not torch.cuda.is_available():
            raise ValueError("KVPool.pinned: pinning host memory needs CUDA, and torch sees no CUDA device")
        shape = (num_pages, *layout.page_shape)
        self._mapping: mmap.mmap | None = None
        lazy = lazy and dev.type == "cpu" and not pinned  # pinning touches every page anyway
        if lazy:
            # Zero-filled by the kernel on first touch: finite values everywhere, as attention
            # needs of the slots it reads and masks, without touching a page now.
            self._mapping = mmap.mmap(-1, num_pages * layout.page_bytes)
            raw = torch.frombuffer(self._mapping, dtype=torch.uint8)
            data = raw.view(layout.torch_dtype).view(shape)
        else:
            data = torch.empty(shape, dtype=layout.torch_dtype, device=dev, pin_memory=bool(pinned))
        flat = data.view(num_pages, layout.page_elems)
        self.layout = layout
        self.num_pages = num_pages
        self.device = dev
        self.pinned = bool(pinned)
        self.name = name or f"{dev.type}-pool"
        self.data = data
        self._bytes = flat.view(torch.uint8)
        self._words = self._bytes.view(torch.int64)
        if not lazy:
            self._words.zero_()  # pre-fault every page now, not during the first copy

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.layout.page_bytes

    def bytes_view(self) -> torch.Tensor:
        """`(num_pages, page_bytes)` uint8 view of the pool's storage (no copy)."""
        return self._bytes

    def words_view(self) -> torch.Tensor:
        """`(num_pages, page_bytes // 8)` int64 view of the pool's storage (no copy)."""
        return self._words

    def page(self, index: int) -> torch.Tensor:
        """The page at `index`, as a view of shape `layout.page_shape`."""
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"{self.name}: page index must be an int, got {index!r}")
        if not 0 <= index < self.num_pages:
            raise IndexError(f"{self.name}: page {index} out of range [0, {self.num_pages})")
        return self.data[int(index)]

    def indices(self, pages: PageIndices, *, what: str = "pages", distinct: bool = False) -> np.ndarray:
        """`pages` checked against this pool, as a 1-D int64 array.

        `distinct` rejects repeats: a scatter that writes one page twice has no defined result.
        """
        if isinstance(pages, torch.Tensor):
            pages = pages.detach().cpu().numpy()
        arr = np.asarray(pages)
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(
                f"{self.name}: {what} must be a 1-D sequence of ints, got dtype {arr.dtype} shape {arr.shape}"
            )
        bad = np.flatnonzero((arr < 0) | (arr >= self.num_pages))
        if bad.size:
            raise IndexError(
                f"{self.name}: {what}[{bad[0]}] = {arr[bad[0]]} out of range [0, {self.num_pages})"
            )
        arr = arr.astype(np.int64, copy=False)
        if distinct:
            uniq, counts = np.unique(arr, return_counts=True)
            if uniq.size != arr.size:
                raise ValueError(f"{self.name}: {what} repeats page {uniq[counts > 1][0]}")
        return arr
