"""Pin glibc's mmap threshold so that the memory of freed tensors goes back to the system.

glibc serves allocations above its mmap threshold with mmap, but it raises the threshold each
time such a chunk is freed (up to 32 MiB on 64-bit), after which large allocations come from the
heap arenas. A node that allocates tensors of ever-changing sizes (a sequence's KV grows token by
token) then fragments the arenas and its RSS creeps up: about 2-5 KB per request in the soak
(`docs/reliability.md`). `mallopt(M_MMAP_THRESHOLD, n)` fixes the threshold, which also turns the
dynamic adjustment off; measured in the same run, RSS then stays flat, at the cost of more mmap
calls (about a fifth fewer requests per second for the CPU-only test model, whose decode steps
are mostly small allocations).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # from glibc's <malloc.h>
DEFAULT_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: it refuses more


def pin_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fix the threshold at `nbytes` (0: leave glibc adaptive). True if glibc took it; False
    where the C library has no `mallopt` (not glibc) or refused the value."""
    if not 0 <= nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap threshold: expected 0..{MAX_MMAP_THRESHOLD} bytes, got {nbytes}")
    if nbytes == 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, nbytes) == 1
