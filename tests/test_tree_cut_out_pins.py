"""A pin on an L2 node that a failed load-back cut out of the tree walks up through its
ancestors when it lets go; an ancestor that leaves the tree meanwhile (its last tier evicted)
keeps that path. Found by the stateful decode-node test: the events below left a pin whose
path ran into a node with no parent, so `check()` failed and the pin's release would have
crashed."""

from __future__ import annotations

from hicache.core.config import DecodeConfig
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.events import (  # noqa: F401  (the events below name them)
    AbortRequested,
    BackupDone,
    Decoded,
    Finished,
    KVArrived,
    KVFailed,
    LoadDone,
    RequestArrived,
    Tick,
)

CONFIG = DecodeConfig(
    l1_pages=13,
    l2_pages=5,
    page_size=3,
    eviction="fifo",
    storage=False,
    prefetch_policy="best_effort",
    prefetch_threshold_tokens=0,
    load_batches_in_flight=1,
    decode_reserve_tokens=1,
    transfer_retries=0,
    max_running=1,
)

EVENTS = [
    RequestArrived(at=0.0, req="r0", prompt_len=1, keys=(), priority=0),
    RequestArrived(
        at=0.0, req="r1", prompt_len=7, keys=(2627855000660678870, 3517636089459908949), priority=1
    ),
    Tick(at=0.001),
    KVArrived(at=0.001, req="r0", transfer=1),
    KVArrived(at=0.001, req="r1", transfer=2),
    Decoded(at=0.001, req="r0", tokens=3, new_keys=(15866404888638493590,)),
    RequestArrived(
        at=0.001, req="r2", prompt_len=7, keys=(2627855000660678870, 6919810877586323453), priority=2
    ),
    Tick(at=0.002),
    KVArrived(at=0.002, req="r2", transfer=3),
    Decoded(at=0.002, req="r0", tokens=3, new_keys=(6305139246034862320,)),
    Tick(at=0.003),
    Finished(at=0.003, req="r0"),
    RequestArrived(
        at=0.003, req="r3", prompt_len=7, keys=(2627855000660678870, 15434934178235816546), priority=0
    ),
    Tick(at=0.004),
    BackupDone(at=0.004, op=4, failed=()),
    Decoded(at=0.004, req="r1", tokens=3, new_keys=(10684508912231574172,)),
    Tick(at=0.005),
    KVArrived(at=0.005, req="r3", transfer=5),
    Decoded(at=0.005, req="r1", tokens=3, new_keys=(11171712973777011079,)),
    Tick(at=0.006),
    RequestArrived(at=0.006, req="r4", prompt_len=1, keys=(), priority=0),
    Finished(at=0.006, req="r1"),
    Tick(at=0.007),
    BackupDone(at=0.007, op=6, failed=()),
    Decoded(at=0.007, req="r2", tokens=3, new_keys=(17984041945157649703,)),
    Tick(at=0.008),
    KVFailed(at=0.008, req="r4", transfer=7, reason="link down"),
    AbortRequested(at=0.008, req="r2", reason="client went away"),
    Decoded(at=0.008, req="r3", tokens=3, new_keys=(247919527791535737,)),
    RequestArrived(
        at=0.008,
        req="r5",
        prompt_len=14,
        keys=(2627855000660678870, 6919810877586323453, 17984041945157649703, 4242029879262037557),
        priority=2,
    ),
    Tick(at=0.009000000000000001),
    KVArrived(at=0.009000000000000001, req="r5", transfer=8),
    Decoded(at=0.009000000000000001, req="r3", tokens=3, new_keys=(7835782508468813709,)),
    RequestArrived(
        at=0.009000000000000001,
        req="r6",
        prompt_len=17,
        keys=(
            2627855000660678870,
            15434934178235816546,
            247919527791535737,
            7835782508468813709,
            5143727272586491488,
        ),
        priority=0,
    ),
    Tick(at=0.010000000000000002),
    LoadDone(at=0.010000000000000002, op=9, failed=()),
    Finished(at=0.010000000000000002, req="r3"),
    RequestArrived(
        at=0.010000000000000002,
        req="r7",
        prompt_len=17,
        keys=(
            2627855000660678870,
            3517636089459908949,
            10684508912231574172,
            11171712973777011079,
            2426700537363718355,
        ),
        priority=1,
    ),
    Tick(at=0.011000000000000003),
    BackupDone(at=0.011000000000000003, op=10, failed=()),
    Decoded(at=0.011000000000000003, req="r5", tokens=3, new_keys=(17382898983107142040,)),
    Tick(at=0.012000000000000004),
    KVArrived(at=0.012000000000000004, req="r6", transfer=11),
    Decoded(at=0.012000000000000004, req="r5", tokens=3, new_keys=(16460599193872339637,)),
    Tick(at=0.013000000000000005),
    LoadDone(at=0.013000000000000005, op=12, failed=(0,)),
    BackupDone(at=0.013000000000000005, op=13, failed=()),
    Tick(at=0.014000000000000005),
]


def test_a_cut_out_pin_keeps_its_path_when_an_ancestor_leaves_the_tree() -> None:
    core = DecodeNodeCore(CONFIG)
    for event in EVENTS:
        core.handle(event)
        core.check()
    assert core.tree.live_pins  # the pin on the cut-out node is still held here
