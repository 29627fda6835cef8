"""What the front door knows of the nodes behind it: a part that is down (a node process that
exited, an attached node that stopped answering) makes `/health` and `/health_generate` answer
503 at once, naming it, until it is back."""

from __future__ import annotations

import logging

log = logging.getLogger("hicache.runtime.serving")


class Health:
    """The parts that are down, each with its reason; healthy when none is."""

    def __init__(self) -> None:
        self._down: dict[str, str] = {}

    def down(self, part: str, reason: str) -> None:
        if self._down.get(part) != reason:
            log.error("%s is down: %s", part, reason)
        self._down[part] = reason

    def up(self, part: str) -> None:
        if self._down.pop(part, None) is not None:
            log.warning("%s is back", part)

    @property
    def ok(self) -> bool:
        return not self._down

    def problem(self) -> str | None:
        """One line naming every part that is down and why; None when all are up."""
        if not self._down:
            return None
        return "; ".join(f"{part}: {why}" for part, why in sorted(self._down.items()))
