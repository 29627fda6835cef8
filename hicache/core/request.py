"""What the decode-node core knows about one request, and what it accounts to it."""

from __future__ import annotations

import attrs

from hicache.core.account import Account
from hicache.core.receipts import HostPin, LockReceipt
from hicache.core.states import State


@attrs.define(slots=True, eq=False)
class Request:
    """A request's state and everything it holds. Slots for page i are `slots[i]`; the first
    `shared` of them belong to the tree (locked by `lock`), the rest to the request."""

    id: str
    prompt_len: int
    keys: list[int]
    arrival: float
    priority: int = 0
    state: State = State.QUEUED
    admitted_at: float = -1.0
    ready_at: float = -1.0  # when its KV became complete (this admission)
    # Admission (the head of the queue keeps its match until it is admitted).
    matched: bool = False
    device_pages: int = 0
    host_pages: int = 0
    host_slots_l2: list[int] = attrs.Factory(list)  # the tree's L2 slots of the L2 span
    lock: LockReceipt | None = None
    pin: HostPin | None = None
    slots: list[int] = attrs.Factory(list)
    shared: int = 0
    reserve: int = 0  # decode pages reserved and not yet taken
    # Restore plan.
    l2_pages: int = 0  # L2 span restored locally
    l3_pages: int = 0  # L3 pages planned for prefetch
    prefetch_op: int | None = None
    prefetch_slots: list[int] = attrs.Factory(list)  # request-owned L2 slots of the prefetch
    prefetch_open: bool = False  # the prefetch's usable length is not settled yet
    loads: int = 0  # load-back entries queued or in flight
    promised_pages: int = -1  # -1: nothing requested from prefill yet
    transfers: set[int] = attrs.Factory(set)
    decoded: int = 0
    account: Account = attrs.Factory(Account)  # of the latest admission
    outcome: str = ""  # an `Outcome` once it ended
    reason: str = ""

    @property
    def owner(self) -> tuple[str, str]:
        return ("req", self.id)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.decoded

    def reset_admission(self) -> None:
        """Forget one admission's match and plan (on resume after a retraction)."""
        self.matched = False
        self.device_pages = self.host_pages = self.shared = self.reserve = 0
        self.l2_pages = self.l3_pages = self.loads = 0
        self.host_slots_l2 = []
        self.slots = []
        self.prefetch_op = None
        self.prefetch_slots = []
        self.prefetch_open = False
        self.promised_pages = -1
        self.transfers = set()
        self.lock = self.pin = None
        retractions = self.account.retractions
        self.account = Account(retractions=retractions)
