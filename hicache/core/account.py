"""Where a request's prompt KV came from: the account a decode node reports per request."""

from __future__ import annotations

from hicache.core.value import Value

_FIELDS = ("l1", "l2", "l3", "transferred", "fallback", "retractions")


class Account(Value):
    """Tokens of the prompt by source, for the request's latest admission.

    A value (`hicache.core.value`): `add` makes a new one."""

    __slots__ = _FIELDS

    def __init__(
        self,
        l1: int = 0,  # already on L1 at admission
        l2: int = 0,  # loaded back from L2
        l3: int = 0,  # prefetched from L3 and loaded back
        transferred: int = 0,  # received from prefill (including fallback ranges)
        fallback: int = 0,  # promised for local restore, then re-requested from prefill
        retractions: int = 0,
    ) -> None:
        self.l1 = l1
        self.l2 = l2
        self.l3 = l3
        self.transferred = transferred
        self.fallback = fallback
        self.retractions = retractions

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        return (self.l1, self.l2, self.l3, self.transferred, self.fallback, self.retractions)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(_FIELDS, self.as_tuple(), strict=True))

    def fields(self) -> tuple[tuple[str, object], ...]:
        return tuple(zip(_FIELDS, self.as_tuple(), strict=True))

    @property
    def cached(self) -> int:
        return self.l1 + self.l2 + self.l3

    def add(
        self,
        *,
        l1: int = 0,
        l2: int = 0,
        l3: int = 0,
        transferred: int = 0,
        fallback: int = 0,
        retractions: int = 0,
    ) -> Account:
        """This account with the given tokens (or retractions) added (accounts are values: the
        one a command carries never changes afterwards)."""
        return Account(
            self.l1 + l1,
            self.l2 + l2,
            self.l3 + l3,
            self.transferred + transferred,
            self.fallback + fallback,
            self.retractions + retractions,
        )
