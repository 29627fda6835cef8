"""How many pages a decode node's L1 gets when it is sized from memory rather than counted.

SGLang sizes its device KV pool with `--max-total-tokens` (that many tokens of KV) or
`--mem-fraction-static` (the share of the device's memory that weights and the KV pool may
take together: the pool gets what is still available once the weights are loaded, less the
`1 - fraction` of the total kept back for everything else). A node here does the same, with the
machine's memory standing in for the GPU's when L1 lives in host memory (this machine has no
GPU): `available` is what the kernel says could still be allocated (`MemAvailable`), `total` the
physical memory or the cgroup's limit, whichever is lower. On a GPU (`--device cuda`) they are
what the CUDA driver reports for that GPU (`torch.cuda.mem_get_info`). Both flags given: the
smaller L1.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


@attrs.frozen
class Memory:
    """Bytes of memory in all, and bytes that can still be allocated."""

    total: int
    available: int


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> Memory:
    """This machine's memory as `l1_pages_for` takes it (Linux: /proc/meminfo, cgroup limits)."""
    fields: dict[str, int] = {}
    for line in meminfo.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024  # kB
    total = fields["MemTotal"]
    available = fields.get("MemAvailable", fields.get("MemFree", 0))
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return Memory(total=total, available=min(available, total))


def device_memory(device: torch.device) -> Memory:
    """The memory L1 is sized from on `device`: a GPU's own, or the host's for the CPU."""
    if device.type != "cuda":
        return host_memory()
    free, total = torch.cuda.mem_get_info(device)
    return Memory(total=int(total), available=int(free))


class SizingError(ValueError):
    """L1 cannot be sized as asked; the message names the flag and the figures."""


def l1_pages_for(
    *,
    page_size: int,
    page_bytes: int,
    max_total_tokens: int = 0,
    mem_fraction_static: float = 0.0,
    memory: Memory | None = None,
) -> int | None:
    """L1's pages from `--max-total-tokens` (> 0) and/or `--mem-fraction-static` (> 0), or None
    when neither is given (the node keeps `--l1-pages`). `memory` is read after the model's
    weights are loaded (default: `host_memory()`)."""
    sizes: list[int] = []
    if max_total_tokens > 0:
        pages = max_total_tokens // page_size
        if pages < 1:
            raise SizingError(
                f"--max-total-tokens {max_total_tokens}: fewer tokens than one page ({page_size})"
            )
        sizes.append(pages)
    if mem_fraction_static > 0:
        if not mem_fraction_static < 1:
            raise SizingError(f"--mem-fraction-static {mem_fraction_static}: expected a number in (0, 1)")
        mem = memory if memory is not None else host_memory()
        budget = mem.available - int(mem.total * (1.0 - mem_fraction_static))
        pages = budget // page_bytes if budget > 0 else 0
        if pages < 1:
            raise SizingError(
                f"--mem-fraction-static {mem_fraction_static}: leaves no room for one KV page "
                f"({page_bytes} bytes): {mem.available / 2**30:.2f} GiB available of "
                f"{mem.total / 2**30:.2f} GiB, {1 - mem_fraction_static:.2f} of it kept back"
            )
        sizes.append(pages)
    return min(sizes) if sizes else None
