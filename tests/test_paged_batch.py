"""The paged, batched forward: one pass over many requests whose K/V lives in a pool's pages.

In float64 it must equal the monolithic pass (one forward over each whole sequence) within 1e-9
and give the same greedy tokens, whatever the batch holds, the page size, the page order, how
much of each prompt was already cached, and which requests join or leave between steps.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_helpers import one_thread, rel_err  # noqa: F401  (a fixture)

from hicache.runtime.model.llama import RopeScaling, TinyConfig, TinyModel, from_pages, greedy_token

MODEL = TinyModel(TinyConfig())


pytestmark = pytest.mark.usefixtures("one_thread")


def make_pool(model: TinyModel, num_pages: int, page_size: int, seed: int) -> torch.Tensor:
    """A pool whose every slot holds finite garbage, as reused pages do."""
    cfg = model.config
    shape = (num_pages, cfg.layers, 2, page_size, cfg.kv_heads, cfg.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=cfg.torch_dtype) * 100


configs = st.builds(
    lambda layers, kv_heads, group, bias, tied, scaling, seed: TinyConfig(
        layers=layers,
        q_heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=8,
        vocab=97,
        ffn=24,
        seed=seed,
        qkv_bias=bias,
        tied_embeddings=tied,
        rope_scaling=scaling,
    ),
    layers=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    bias=st.booleans(),
    tied=st.booleans(),
    scaling=st.sampled_from(
        [
            None,
            RopeScaling(kind="linear", factor=4.0),
            RopeScaling(
                kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=16
            ),
        ]
    ),
    seed=st.integers(0, 2**20),
)


@settings(max_examples=examples(40), deadline=None)
@given(config=configs, page_size=st.integers(1, 8), data=st.data())
def test_batched_paged_serving_matches_the_monolithic_pass(
    config: TinyConfig, page_size: int, data: st.DataObject
) -> None:
    model = TinyModel(config)
    rng = random.Random(data.draw(st.integers(0, 2**31), label="rng"))
    batch = data.draw(st.integers(1, 5), label="batch")
    prompts = [[rng.randrange(config.vocab) for _ in range(rng.randint(1, 30))] for _ in range(batch)]
    cached = [rng.randint(0, len(p) - 1) for p in prompts]  # a prefix already in pages (restored)
    steps = [rng.randint(0, 5) for _ in range(batch)]
    need = [-(-(len(p) + s) // page_size) for p, s in zip(prompts, steps, strict=True)]
    spare = 3
    pool = make_pool(model, sum(need) + spare, page_size, seed=rng.randrange(2**31))
    pages = list(range(sum(need) + spare))
    rng.shuffle(pages)
    tables = [pages[sum(need[:b]) : sum(need[: b + 1])] for b in range(batch)]
    untouched = {p: pool[p].clone() for p in pages[sum(need) :]}
    for b, prompt in enumerate(prompts):
        if cached[b]:
            prefix = model.monolithic_kv(torch.tensor(prompt[: cached[b]]))
            for pos in range(cached[b]):
                pool[tables[b][pos // page_size], :, :, pos % page_size] = prefix[:, :, pos]

    # One batched prefill of every request's uncached increment, then decode steps in which
    # finished requests leave and the rest come in a new order each time.
    logits = model.forward_paged(pool, tables, cached, [p[c:] for p, c in zip(prompts, cached, strict=True)])
    out = [[greedy_token(logits[b])] for b in range(batch)]
    last_logits = {b: logits[b] for b in range(batch)}
    for step in range(max(steps)):
        live = [b for b in range(batch) if steps[b] > step]
        rng.shuffle(live)
        positions = [len(prompts[b]) + step for b in live]
        logits = model.decode_batch(pool, [tables[b] for b in live], positions, [out[b][-1] for b in live])
        for row, b in enumerate(live):
            out[b].append(greedy_token(logits[row]))
            last_logits[b] = logits[row]

    for b, prompt in enumerate(prompts):
        want, _ = model.generate(torch.tensor(prompt), steps[b] + 1)
        assert out[b] == want.tolist()
        sequence = torch.tensor(prompt + out[b][:-1])
        kv, logits_ref = model.forward(sequence)
        assert rel_err(from_pages(pool[tables[b]], len(sequence)), kv) < 1e-9
        assert rel_err(last_logits[b], logits_ref) < 1e-9
    for p, before in untouched.items():
        assert torch.equal(pool[p], before)


def test_decode_batch_writes_exactly_each_requests_slot() -> None:
    cfg, page_size = MODEL.config, 4
    pool = make_pool(MODEL, 12, page_size, seed=1)
    before = pool.clone()
    tables, positions = [[3, 7, 1], [0, 5], [9]], [9, 4, 0]
    MODEL.decode_batch(pool, tables, positions, [5, 6, 7])
    changed = (pool != before).reshape(12, cfg.layers, 2, page_size, -1).any(dim=-1)
    want = torch.zeros_like(changed)
    for table, pos in zip(tables, positions, strict=True):
        want[table[pos // page_size], :, :, pos % page_size] = True
    assert torch.equal(changed, want)


def test_numpy_and_torch_integers_work_as_page_tables_positions_and_tokens() -> None:
    page_size = 4
    pool = make_pool(MODEL, 10, page_size, seed=6)
    as_lists = MODEL.decode_batch(pool.clone(), [[3, 7], [1]], [5, 2], [11, 12])
    slots = np.array([3, 7, 1], dtype=np.int64)  # a KVPool hands out numpy slot arrays
    as_arrays = MODEL.decode_batch(
        pool.clone(), [slots[:2], slots[2:]], list(np.array([5, 2])), torch.tensor([11, 12])
    )
    assert torch.equal(as_lists, as_arrays)
    checked = MODEL.forward_paged(pool.clone(), [slots[:2], slots[2:]], list(np.array([5, 2])), [[11], [12]])
    assert torch.equal(as_lists, checked)
    with pytest.raises(ValueError, match=r"positions\[0\]: expected an integer >= 0, got 1.5"):
        MODEL.forward_paged(pool, [[0]], [1.5], [[1]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"page_tables\[0\]\[0\]: expected a page"):
        MODEL.forward_paged(pool, [[True]], [0], [[1]])


def test_a_request_gets_the_same_logits_alone_or_in_any_batch() -> None:
    page_size = 3
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (7, 1, 12, 5)]
    pool = make_pool(MODEL, 40, page_size, seed=2)
    tables = [list(range(10 * b, 10 * b + 10)) for b in range(4)]
    for b, prompt in enumerate(prompts):
        if len(prompt) > 1:
            MODEL.prefill_into(pool, tables[b], 0, prompt[:-1])
    alone = [
        MODEL.decode_batch(pool.clone(), [tables[b]], [len(p) - 1], [p[-1]])[0] for b, p in enumerate(prompts)
    ]
    for order in ([0, 1, 2, 3], [3, 1], [2, 0, 3]):
        logits = MODEL.decode_batch(
            pool.clone(),
            [tables[b] for b in order],
            [len(prompts[b]) - 1 for b in order],
            [prompts[b][-1] for b in order],
        )
        for row, b in enumerate(order):
            assert rel_err(logits[row], alone[b]) < 1e-12
            assert greedy_token(logits[row]) == greedy_token(alone[b])


def test_prefill_into_in_chunks_equals_one_prefill() -> None:
    page_size = 5
    tokens = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    table = [4, 2, 6, 0, 7, 1, 3, 5]
    whole = make_pool(MODEL, 8, page_size, seed=3)
    chunked = whole.clone()
    one = MODEL.prefill_into(whole, table, 0, tokens)
    start = 0
    for size in (1, 9, 4, 13, 10):
        last = MODEL.prefill_into(chunked, table, start, tokens[start : start + size])
        start += size
    kv, ref = MODEL.forward(torch.tensor(tokens))
    assert rel_err(from_pages(chunked[table], 37), kv) < 1e-9
    assert rel_err(from_pages(whole[table], 37), kv) < 1e-9
    assert rel_err(last, ref) < 1e-9 and rel_err(one, ref) < 1e-9


def test_batched_prefill_of_several_lengths_in_float32() -> None:
    model = TinyModel(TinyConfig(dtype="float32", qkv_bias=True))
    page_size = 4
    rng = random.Random(9)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (3, 17, 9)]
    pool = make_pool(model, 30, page_size, seed=4)
    tables = [list(range(10 * b, 10 * b + 10)) for b in range(3)]
    logits = model.forward_paged(pool, tables, [0, 0, 0], prompts)
    for b, prompt in enumerate(prompts):
        kv, ref = model.forward(torch.tensor(prompt))
        assert rel_err(from_pages(pool[tables[b]], len(prompt)), kv) < 1e-5
        assert rel_err(logits[b], ref) < 1e-5


def test_bad_paged_input_names_the_argument() -> None:
    """`forward_paged` checks every value (what prefill and tests hand it); the decode step
    checks only what costs the same for any batch: the pool and the batch's lengths."""
    cfg, page_size = MODEL.config, 4
    pool = make_pool(MODEL, 6, page_size, seed=5)
    for forward in (MODEL.decode_batch, lambda p, t, s, x: MODEL.forward_paged(p, t, s, [[i] for i in x])):
        with pytest.raises(ValueError, match="pool: expected a contiguous"):
            forward(pool.float(), [[0]], [0], [1])
        with pytest.raises(ValueError, match="pool: expected shape"):
            forward(pool[0], [[0]], [0], [1])
        with pytest.raises(ValueError, match="expected equal non-zero lengths"):
            forward(pool, [[0], [1]], [0], [1, 2])
        with pytest.raises(ValueError, match="expected equal non-zero lengths"):
            forward(pool, [], [], [])
    with pytest.raises(
        ValueError, match=r"page_tables\[1\]: positions up to 4 need 2 pages of 4 tokens, got 1"
    ):
        MODEL.forward_paged(pool, [[0, 1], [2]], [4, 4], [[1], [2]])
    with pytest.raises(ValueError, match=r"page_tables\[0\]\[1\]: expected a page in \[0, 6\), got 6"):
        MODEL.forward_paged(pool, [[0, 6]], [5], [[1]])
    with pytest.raises(ValueError, match=r"page_tables\[1\]: position 2 would write page 0 slot 2"):
        MODEL.forward_paged(pool, [[0], [0]], [2, 2], [[1], [2]])
    with pytest.raises(
        ValueError, match=rf"tokens\[0\]: expected a non-empty list of ids in \[0, {cfg.vocab}\)"
    ):
        MODEL.forward_paged(pool, [[0]], [0], [[cfg.vocab]])
    with pytest.raises(ValueError, match=r"tokens\[0\]: expected a non-empty list"):
        MODEL.forward_paged(pool, [[0]], [0], [[]])
    with pytest.raises(ValueError, match=r"positions\[0\]: expected an integer >= 0"):
        MODEL.forward_paged(pool, [[0]], [-1], [[1]])
    before = pool.clone()
    with pytest.raises(ValueError):
        MODEL.forward_paged(pool, [[0], [0]], [2, 2], [[1], [2]])
    assert torch.equal(pool, before)  # a refused batch writes nothing
