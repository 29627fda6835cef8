"""Commands the core hands to a driver: I/O to perform, described as data.

The core never copies a byte itself; a driver executes each command and reports its
completion back as an event carrying the command's `op` id.
"""

from __future__ import annotations

import attrs


@attrs.frozen(slots=True)
class Backup:
    """Copy device (L1) pages to host (L2) pages: `device_slots[i]` -> `host_slots[i]`."""

    op: int
    device_slots: tuple[int, ...]
    host_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class Store:
    """Write host (L2) pages to shared storage (L3) under their page keys."""

    op: int
    keys: tuple[int, ...]
    host_slots: tuple[int, ...]


Command = Backup | Store
