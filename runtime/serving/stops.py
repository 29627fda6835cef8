"""Stop strings: the front door's, because only it sees text; the backend sees token ids.

Text is streamed, and a stop string may arrive split over several tokens, so any tail of the
text that could still grow into a stop string is held back until it either completes (the
text is cut before it) or cannot (it is released). Cumulative streams (SGLang's) therefore
never shrink.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...], *, keep: bool = False) -> None:
        """`keep`: the text ends after the stop string instead of before it (SGLang's
        `no_stop_trim`)."""
        self._stops = tuple(s for s in stops if s)
        self._keep = keep
        self._longest = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._released = 0
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """All the text released so far."""
        return self._text[: self._released]

    def feed(self, delta: str, *, final: bool = False) -> str:
        """Add final text; return what may be shown now. After a match (see `matched`) the
        text ends before the stop string (after it, with `keep`) and feeding more changes
        nothing."""
        if self.matched is not None:
            return ""
        start = max(0, len(self._text) - self._longest + 1)
        self._text += delta
        cut = self._first_match(start)
        if cut is not None:
            assert self.matched is not None
            self._text = self._text[: cut + len(self.matched) if self._keep else cut]
            final = True
        end = len(self._text) if final else len(self._text) - self._held()
        out = self._text[self._released : end]
        self._released = max(self._released, end)
        return out

    def _first_match(self, start: int) -> int | None:
        best: int | None = None
        for stop in self._stops:
            at = self._text.find(stop, start)
            if at >= 0 and (best is None or at < best):
                best, self.matched = at, stop
        return best

    def _held(self) -> int:
        """The longest tail of the text that is a proper prefix of some stop string."""
        for n in range(min(self._longest - 1, len(self._text)), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
