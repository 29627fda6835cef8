"""KV streamed layer group by layer group while prefill computes it: the first group's WRITE
leaves before prefill has computed the next layer, the decode node hears of the transfer once,
with the last group, and the KV it decodes from is bit-exact whatever the grouping."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
from node_pair import GUARD_S, node_pair

from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.prefill.prefill_cache import LayerGroups
from hicache.runtime.transfer.tcp import TcpEngine

LAYERS = TinyConfig().layers  # the decode node's model is the same (its fingerprint is checked)


class Gated(TinyModel):
    """A model whose prefill does not go past layer 0 until the node posted a WRITE of a layer
    group: with KV sent only after prefill, it would wait in vain (then fail)."""

    def __init__(self, posted: threading.Event) -> None:
        super().__init__(TinyConfig())
        self.posted = posted
        self.waited_for_a_post = 0

    def prefill_into(
        self,
        pool: torch.Tensor,
        page_table: Sequence[int],
        start: int,
        tokens: Sequence[int] | torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        def hook(index: int) -> None:
            if on_layer is not None:
                on_layer(index)
            if index == 0:
                assert self.posted.wait(GUARD_S), "no layer group was sent while prefill computed"
                self.waited_for_a_post += 1
                self.posted.clear()

        return super().prefill_into(pool, page_table, start, tokens, hook)


def recording_engine(posted: threading.Event, spans: list[Any]) -> Callable[[], TcpEngine]:
    class Recording(TcpEngine):
        async def post(self, *args: Any, **kw: Any) -> Any:
            spans.append((kw.get("span"), kw.get("final", True)))
            if kw.get("span") is not None:
                posted.set()
            return await super().post(*args, **kw)

    return lambda: Recording(name="prefill")


async def test_the_first_layer_group_leaves_while_prefill_computes_the_rest(tmp_path: Path) -> None:
    posted = threading.Event()
    spans: list[Any] = []
    model = Gated(posted)
    async with node_pair(
        tmp_path,
        prefill={"layer_groups": LAYERS},
        prefill_model=model,
        prefill_engine=recording_engine(posted, spans),
    ) as pair:
        tokens = list(range(5, 5 + 3 * 16 + 7))
        with trio.fail_after(GUARD_S * 2):
            reply, kv = await pair.client.generate("r", tokens, 3, verify=True)
        assert reply["outcome"] == "finished", reply
        assert pair.ledger.check(tokens, 3, reply, kv) == []
    assert model.waited_for_a_post == 1
    assert pair.prefill.streamed == 1
    assert [final for _, final in spans] == [False] * (LAYERS - 1) + [True]  # notified with the last
    assert [s.offset for s, _ in spans] == sorted(s.offset for s, _ in spans)


@pytest.mark.parametrize("groups", [0, 1, 3])
async def test_any_grouping_decodes_from_the_same_kv(tmp_path: Path, groups: int) -> None:
    async with node_pair(tmp_path, prefill={"layer_groups": groups}) as pair:
        rng = np.random.default_rng(groups)
        prompt = rng.integers(0, 512, 75).tolist()
        for rid in ("a", "b"):  # b: from the decode node's cache, the increment from prefill
            with trio.fail_after(GUARD_S):
                reply, kv = await pair.client.generate(rid, prompt, 4, verify=True)
            assert reply["outcome"] == "finished", reply
            assert pair.ledger.check(prompt, 4, reply, kv) == []
            prompt = prompt + reply["tokens"] + rng.integers(0, 512, 20).tolist()
        assert pair.prefill.streamed == (2 if groups else 0)


def test_layer_groups_split_the_layers_evenly() -> None:
    for layers, groups, ends in ((4, 4, [1, 2, 3, 4]), (30, 4, [8, 15, 22, 30]), (2, 8, [1, 2]), (5, 1, [5])):
        assert LayerGroups(layers, groups, lambda *a: None).ends == ends
    with pytest.raises(ValueError, match="groups: expected >= 1"):
        LayerGroups(4, 0, lambda *a: None)
