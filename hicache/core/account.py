"""Where a request's prompt KV came from: the account a decode node reports per request."""

from __future__ import annotations

import attrs


@attrs.frozen(slots=True)
class Account:
    """Tokens of the prompt by source, for the request's latest admission."""

    l1: int = 0  # already on L1 at admission
    l2: int = 0  # loaded back from L2
    l3: int = 0  # prefetched from L3 and loaded back
    transferred: int = 0  # received from prefill (including fallback ranges)
    fallback: int = 0  # promised for local restore, then re-requested from prefill
    retractions: int = 0

    @property
    def cached(self) -> int:
        return self.l1 + self.l2 + self.l3

    def add(self, **counts: int) -> Account:
        """This account with `counts` added to the named fields (accounts are values: the one
        a command carries never changes afterwards)."""
        return attrs.evolve(self, **{k: getattr(self, k) + v for k, v in counts.items()})
