"""K/V in each dtype a node can keep it in (`--kv-cache-dtype`): what prefill computes into its
pages is the ground truth (one monolithic forward whose K/V is kept in that dtype), and it stays
that, bit for bit, through every tier a page travels: a transfer into the decode node's L1
(the TCP engine), L1 -> L2 (the copy engine), L2 -> the L3 file store -> L2 -> L1. The dtype is
the layout's, so a store or a peer of another dtype is refused rather than misread."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from builders import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch_helpers import one_thread  # noqa: F401  (a fixture)

from hicache.runtime.kv.copy_engine import CopyEngine
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.model.llama import TinyConfig, TinyModel, from_pages
from hicache.runtime.nodes import model_layout
from hicache.runtime.storage import FileStore
from hicache.runtime.transfer import TcpEngine, XferState
from hicache.runtime.wire import compat

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 4
KV_DTYPES = ["bfloat16", "float16", "float32"]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
GUARD_S = 10  # a guard against hangs, never a speed assertion


@functools.cache
def model(kv_dtype: str) -> TinyModel:
    """A float32 tiny model keeping its K/V in `kv_dtype`."""
    return TinyModel(TinyConfig(dtype="float32", layers=3, seed=5), kv_dtype=kv_dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers: equal bits, not merely equal values (so -0.0 != 0.0, NaNs compare)."""
    return t.contiguous().view(BITS[t.dtype])


async def through_every_tier(m: TinyModel, tokens: list[int], root: Path) -> tuple[torch.Tensor, ...]:
    """Prefill's pages, then the same pages after each hop: (prefill, L1, L2, L1 again via L3)."""
    layout = model_layout(m, PAGE)
    n = -(-len(tokens) // PAGE)
    staging = KVPool(layout, n + 2, name="staging")
    table = list(range(2, n + 2))[::-1]  # pages out of order on purpose
    m.prefill_into(staging.data, table, 0, tokens)
    l1, l2 = KVPool(layout, n + 3, name="L1"), KVPool(layout, n + 1, name="L2")
    l1_pages = list(range(3, n + 3))
    async with TcpEngine(name="prefill") as a, TcpEngine(name="decode") as b:
        ra = a.register("staging", staging.bytes_view())
        b.register("L1", l1.bytes_view())
        await a.add_peer(b.local_info())
        await b.add_peer(a.local_info())
        handle = await a.post("WRITE", ra, table, "decode", "L1", l1_pages, b"kv:1")
        with trio.fail_after(GUARD_S):
            assert await b.next_notif() == ("prefill", b"kv:1")
        assert await a.wait(handle, timeout=GUARD_S) is XferState.DONE
        a.release(handle)
    copies = CopyEngine()
    l2_pages = list(range(1, n + 1))
    await copies.copy(l1, l1_pages, l2, l2_pages)
    store = FileStore(root, layout)
    keys = [1000 + i for i in range(n)]
    try:
        assert await store.put(keys, l2, l2_pages) == []
        l2_again = KVPool(layout, n, name="L2'")
        assert await store.get(keys, l2_again, list(range(n))) == n
    finally:
        await store.aclose()
    l1_again = KVPool(layout, n, name="L1'")
    await copies.copy(l2_again, list(range(n)), l1_again, list(range(n)))
    pages = (staging.data[table], l1.data[l1_pages], l2.data[l2_pages], l1_again.data)
    return tuple(from_pages(p.clone(), len(tokens)) for p in pages)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 23))
async def test_kv_is_the_ground_truth_bit_for_bit_through_every_tier(
    kv_dtype: str, seed: int, length: int
) -> None:
    m = model(kv_dtype)
    tokens = np.random.default_rng(seed).integers(0, m.config.vocab, length).tolist()
    truth = m.monolithic_kv(torch.tensor(tokens))
    assert truth.dtype == getattr(torch, kv_dtype)
    with tempfile.TemporaryDirectory() as root:
        hops = await through_every_tier(m, tokens, Path(root))
    for name, kv in zip(("prefill's pages", "L1", "L2", "L1 via L3"), hops, strict=True):
        assert kv.dtype == truth.dtype, name
        assert torch.equal(bits(kv), bits(truth)), f"{kv_dtype}: {name} differs from the ground truth"


def test_the_layout_carries_the_kv_dtype_and_page_bytes_follow_it() -> None:
    sizes = {name: model_layout(model(name), PAGE) for name in KV_DTYPES}
    for name, layout in sizes.items():
        assert layout.dtype == name
        assert layout.page_bytes == layout.page_elems * getattr(torch, name).itemsize
    assert sizes["bfloat16"].page_bytes * 2 == sizes["float32"].page_bytes
    # Nodes whose pages differ in dtype do not agree on a profile: the hello refuses the peer.
    profiles = {name: compat.profile(sizes[name], None, model(name).config) for name in KV_DTYPES}
    assert len({str(sorted(p.items())) for p in profiles.values()}) == len(KV_DTYPES)


async def test_a_file_store_of_another_kv_dtype_is_a_miss_never_misread(tmp_path: Path) -> None:
    f32, bf16 = model_layout(model("float32"), PAGE), model_layout(model("bfloat16"), PAGE)
    src = KVPool(f32, 1)
    src.data.normal_()
    written = FileStore(tmp_path, f32)
    await written.put([7], src, [0])
    await written.aclose()
    other = FileStore(tmp_path, bf16)
    try:
        assert await other.exists([7]) == 0
        assert await other.get([7], KVPool(bf16, 1), [0]) == 0
    finally:
        await other.aclose()
