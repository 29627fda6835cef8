"""The front door's backend over several decode nodes: each request goes to the node the router
chooses — the simulator's routers (`hicache.core.router`): round robin, session affinity, or
cache-aware from the nodes' own answers to `peek` (how many pages of this prompt each holds, for
this tenant: no node reveals another tenant's pages).

Loads are the requests this front door has in flight at each node; a request counts until its
stream ends, however it ends (finished, failed, or the client gone). A node that cannot be
reached when peeked counts as holding nothing; a request sent to it fails with the reason, and
the next request may go elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Mapping, Sequence

import attrs
import trio

from hicache.core.router import Router
from hicache.runtime.serving.backend import GenerateEvent, GenerateRequest, ModelInfo
from hicache.runtime.serving.node_backend import NodeBackend
from hicache.runtime.wire import protocol

log = logging.getLogger("hicache.runtime.serving")
PEEK_TIMEOUT_S = 1.0  # a node slower than this to say what it holds is taken to hold nothing


@attrs.define(eq=False)
class RoutedBackend:
    nodes: Sequence[NodeBackend]
    router: Router
    loads: list[int] = attrs.field(init=False)
    routed: list[int] = attrs.field(init=False)  # requests sent to each node so far

    def __attrs_post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a routed backend needs at least one decode node")
        if self.router.nodes != len(self.nodes):
            raise ValueError(f"router for {self.router.nodes} nodes, given {len(self.nodes)}")
        self.loads = [0] * len(self.nodes)
        self.routed = [0] * len(self.nodes)

    async def _held(self, req: GenerateRequest) -> list[int]:
        """Pages of the prompt each node holds (0 where a node does not answer in time)."""
        held = [0] * len(self.nodes)

        async def ask(i: int) -> None:
            with trio.move_on_after(PEEK_TIMEOUT_S):
                try:
                    held[i] = await self.nodes[i].peek(req.input_ids, req.tenant)
                except (OSError, protocol.ProtocolError) as exc:
                    log.info("decode node %d did not say what it holds: %s", i, exc)

        async with trio.open_nursery() as nursery:
            for i in range(len(self.nodes)):
                nursery.start_soon(ask, i)
        return held

    async def choose(self, req: GenerateRequest) -> int:
        held = await self._held(req) if self.router.policy == "cache_aware" and len(self.nodes) > 1 else None
        return self.router.choose(req.session, self.loads, (lambda i: held[i]) if held else (lambda i: 0))

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        i = await self.choose(req)
        self.loads[i] += 1
        self.routed[i] += 1
        try:
            async for event in self.nodes[i].generate(req):
                yield event
        finally:
            self.loads[i] -= 1

    async def flush(self) -> None:
        async with trio.open_nursery() as nursery:
            for node in self.nodes:
                nursery.start_soon(node.flush)

    async def stats(self) -> Mapping[str, float]:
        """Every node's counters summed, and each node's under `node<i>_<name>`."""
        per: list[Mapping[str, float]] = [{} for _ in self.nodes]

        async def one(i: int) -> None:
            per[i] = await self.nodes[i].stats()

        async with trio.open_nursery() as nursery:
            for i in range(len(self.nodes)):
                nursery.start_soon(one, i)
        total: dict[str, float] = {}
        for i, stats in enumerate(per):
            for name, value in stats.items():
                total[name] = total.get(name, 0.0) + value
                total[f"node{i}_{name}"] = value
            total[f"node{i}_routed"] = float(self.routed[i])
            total[f"node{i}_in_flight"] = float(self.loads[i])
        return total

    def model_info(self) -> ModelInfo:
        return self.nodes[0].model_info()

    async def aclose(self) -> None:
        for node in self.nodes:
            await node.aclose()
