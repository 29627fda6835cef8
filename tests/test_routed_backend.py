"""The front door over several decode nodes: the router's choice (the same `Router` the
simulator uses), loads that always come back to zero however a request ends, and nodes that do
not answer a peek in time or at all."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping

import attrs
import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from builders import examples
from hypothesis import given, settings

from hicache.core.router import Router
from hicache.runtime.serving.backend import Finished, GenerateEvent, GenerateRequest, Sampling, Tokens
from hicache.runtime.serving.routed_backend import PEEK_TIMEOUT_S, RoutedBackend
from hicache.runtime.wire import protocol


@attrs.define(eq=False)
class FakeNode:
    """A decode node holding `held` pages of every prompt; `fail` makes its stream raise,
    `peek_fails` / `peek_hangs` its peek."""

    held: int = 0
    fail: bool = False
    peek_fails: bool = False
    peek_hangs: bool = False
    served: list[str] = attrs.Factory(list)
    peeked: list[str | None] = attrs.Factory(list)

    async def peek(self, tokens: list[int], tenant: str | None) -> int:
        self.peeked.append(tenant)
        if self.peek_hangs:
            await trio.sleep_forever()
        if self.peek_fails:
            raise protocol.ProtocolError("connection refused")
        return self.held

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        self.served.append(req.rid)
        await trio.sleep(0)
        yield Tokens([1])
        if self.fail:
            raise OSError("node went away")
        yield Tokens([2])
        yield Finished("length")

    async def stats(self) -> Mapping[str, float]:
        return {"running": 1.0, "l1_hits": float(self.held)}

    async def flush(self) -> None:
        self.held = 0

    def model_info(self) -> object:
        return "info"

    async def aclose(self) -> None:
        pass


def request(rid: str, session: str = "", tenant: str | None = None) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2, 3, 4], 2, Sampling(), tenant, session)


def routed(nodes: list[FakeNode], policy: str) -> RoutedBackend:
    return RoutedBackend(nodes, Router(policy, len(nodes)))  # type: ignore[arg-type]


async def drain(backend: RoutedBackend, req: GenerateRequest) -> list[GenerateEvent]:
    return [e async for e in backend.generate(req)]


def test_cache_aware_sends_a_prompt_where_most_of_it_is_held_for_its_tenant() -> None:
    nodes = [FakeNode(held=1), FakeNode(held=5), FakeNode(held=2)]
    backend = routed(nodes, "cache_aware")
    events = trio.run(drain, backend, request("r1", tenant="acme"))
    assert isinstance(events[-1], Finished)
    assert [n.served for n in nodes] == [[], ["r1"], []]
    assert all(n.peeked == ["acme"] for n in nodes)  # each node is asked in the tenant's namespace
    assert backend.loads == [0, 0, 0] and backend.routed == [0, 1, 0]


def test_cache_aware_balances_when_the_load_is_too_uneven() -> None:
    nodes = [FakeNode(held=0), FakeNode(held=9)]
    backend = routed(nodes, "cache_aware")
    backend.loads[1] = 40  # beyond the absolute (32) and relative (1.5x) thresholds
    assert trio.run(backend.choose, request("r")) == 0
    backend.loads[1] = 30
    assert trio.run(backend.choose, request("r")) == 1


def test_a_node_that_cannot_say_what_it_holds_counts_as_holding_nothing() -> None:
    nodes = [FakeNode(held=3), FakeNode(held=9, peek_fails=True), FakeNode(held=7, peek_hangs=True)]
    backend = routed(nodes, "cache_aware")

    async def main() -> tuple[int, float]:
        start = trio.current_time()
        chosen = await backend.choose(request("r"))
        return chosen, trio.current_time() - start

    chosen, waited = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert chosen == 0
    assert waited == pytest.approx(PEEK_TIMEOUT_S)  # the hung node held the choice no longer


def test_session_affinity_keeps_a_conversation_on_one_node() -> None:
    nodes = [FakeNode() for _ in range(3)]
    backend = routed(nodes, "session_affinity")

    async def main() -> None:
        for turn in range(4):
            for session in ("alice", "bob", "carol", "dave"):
                await drain(backend, request(f"{session}-{turn}", session=session))

    trio.run(main)
    for node in nodes:
        sessions = {rid.split("-")[0] for rid in node.served}
        for s in sessions:
            assert sum(rid.startswith(s + "-") for rid in node.served) == 4


@settings(max_examples=examples(80), deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.sampled_from(["finish", "fail", "leave", "cancel"]), st.integers(0, 2)),
        min_size=1,
        max_size=30,
    ),
    policy=st.sampled_from(["round_robin", "session_affinity", "cache_aware"]),
)
def test_every_request_is_counted_once_and_its_load_returned_however_it_ends(
    plan: list[tuple[str, int]], policy: str
) -> None:
    nodes = [FakeNode(held=i) for i in range(3)]
    backend = routed(nodes, policy)

    async def one(i: int, how: str, session: int) -> None:
        for n in nodes:
            n.fail = how == "fail"
        req = request(f"r{i}", session=f"s{session}")
        if how == "cancel":
            with trio.move_on_after(0):
                await drain(backend, req)
            return
        gen = backend.generate(req)
        try:
            async for _event in gen:
                assert sum(backend.loads) >= 1  # counted while it streams
                if how == "leave":
                    break  # the client went away after the first tokens
        except OSError:
            assert how == "fail"
        finally:
            await gen.aclose()

    async def main() -> None:
        for i, (how, session) in enumerate(plan):
            await one(i, how, session)

    trio.run(main)
    assert backend.loads == [0, 0, 0]
    assert sum(how != "cancel" for how, _ in plan) <= sum(backend.routed) <= len(plan)
    assert sum(len(n.served) for n in nodes) == sum(backend.routed)


def test_stats_sum_the_nodes_and_keep_each_nodes_own() -> None:
    nodes = [FakeNode(held=2), FakeNode(held=3)]
    backend = routed(nodes, "round_robin")
    trio.run(drain, backend, request("r"))
    stats = trio.run(backend.stats)
    assert stats["running"] == 2.0 and stats["l1_hits"] == 5.0
    assert (stats["node0_l1_hits"], stats["node1_l1_hits"]) == (2.0, 3.0)
    assert (stats["node0_routed"], stats["node1_routed"]) == (1.0, 0.0)


def test_a_router_for_another_node_count_is_refused() -> None:
    with pytest.raises(ValueError, match="router for 3 nodes, given 2"):
        RoutedBackend([FakeNode(), FakeNode()], Router("round_robin", 3))  # type: ignore[list-item]
