"""A cancellable event of the simulator's loop (`EventLoop.at` / `after`).

Apart from the loop because it subclasses `list`, which the compiled loop cannot (see
`hicache.compiled`); this module stays Python.
"""

from __future__ import annotations

from typing import Any


class EventHandle(list[Any]):
    """A scheduled callback, stored as `[fn, args]`; `cancel()` keeps it from running.

    A list so that the loop stores and unpacks it like the handle-free `(fn, args)` entries;
    cancelling clears `fn`.
    """

    __slots__ = ()

    def cancel(self) -> None:
        self[0] = None

    @property
    def cancelled(self) -> bool:
        return self[0] is None
