"""Page keys extended a page at a time equal the keys of the whole sequence (hicache.core.pages),
and a decode node's live request keeps its keys that way (runtime/decode/live.py)."""

from __future__ import annotations

import numpy as np
import pytest
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.core.pages import (
    MAX_SEED,
    extend_page_keys,
    next_page_key,
    page_keys,
    page_keys_reference,
)
from hicache.runtime.decode.live import Live

SETTINGS = settings(max_examples=examples(150), deadline=None)
seeds = st.integers(0, MAX_SEED)
page_sizes = st.integers(1, 19)


@st.composite
def token_arrays(draw: st.DrawFn, max_len: int = 240) -> np.ndarray:
    """Int32 or int64 tokens over the dtype's full range (sign extension must match too)."""
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    info = np.iinfo(dtype)
    values = draw(st.lists(st.integers(int(info.min), int(info.max)), max_size=max_len))
    return np.array(values, dtype=dtype)


@SETTINGS
@given(tokens=token_arrays(), page_size=page_sizes, seed=seeds)
def test_next_page_key_chains_to_page_keys_in_both_paths(
    tokens: np.ndarray, page_size: int, seed: int
) -> None:
    whole = page_keys(tokens, page_size, seed).tolist()
    assert whole == page_keys_reference(tokens, page_size, seed)
    numba_chain: list[int] = []
    plain_chain: list[int] = []
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        numba_chain.append(next_page_key(numba_chain[-1] if numba_chain else seed, page))
        plain_chain += page_keys_reference(page, page_size, plain_chain[-1] if plain_chain else seed)
    assert numba_chain == whole
    assert plain_chain == whole


@SETTINGS
@given(tokens=token_arrays(), page_size=page_sizes, seed=seeds, data=st.data())
def test_extending_at_any_split_points_gives_the_whole_sequences_keys(
    tokens: np.ndarray, page_size: int, seed: int, data: st.DataObject
) -> None:
    """Keys grown over random cuts of the tokens (each extension gets the tokens after the pages
    keyed so far, up to the next cut, which may fall inside a page) equal one call's."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(tokens)), max_size=6)))
    keys: list[int] = []
    for cut in [*cuts, len(tokens)]:
        same = extend_page_keys(keys, tokens[len(keys) * page_size : cut], page_size, seed)
        assert same is keys
        assert keys == page_keys(tokens[:cut], page_size, seed).tolist()
    assert keys == page_keys_reference(tokens, page_size, seed)


def test_next_page_key_refuses_an_empty_page_and_a_bad_seed() -> None:
    with pytest.raises(ValueError, match="page"):
        next_page_key(1, [])
    with pytest.raises(ValueError, match="seed"):
        next_page_key(-1, [1, 2])


@SETTINGS
@given(
    prompt=st.lists(st.integers(0, 50_000), min_size=1, max_size=90),
    gen=st.lists(st.integers(0, 50_000), max_size=90),
    page_size=page_sizes,
    seed=seeds,
    data=st.data(),
)
def test_a_live_requests_keys_grow_with_its_tokens_and_equal_page_keys(
    prompt: list[int], gen: list[int], page_size: int, seed: int, data: st.DataObject
) -> None:
    """As a decode step adds tokens, asking for the keys of its full pages (in any order of
    page counts) gives `page_keys` of its tokens; the list returned is the caller's own."""
    live = Live("r", list(prompt), max_new=len(gen) + 1, seed=seed, verify=False, arrival=0.0)
    expect = page_keys(prompt + gen, page_size, seed).tolist()
    got = live.page_keys(page_size, len(prompt) // page_size)
    assert got == expect[: len(prompt) // page_size]
    got.append(12345)  # the caller's copy: the request's keys stay as they were
    for token in gen:
        live.gen.append(token)
        full = len(live.tokens) // page_size
        pages = data.draw(st.integers(0, full))
        assert live.page_keys(page_size, pages) == expect[:pages]
        if full:
            index = data.draw(st.integers(0, full - 1))
            assert live.page_key(page_size, index) == expect[index]
    assert live.page_keys(page_size, len(live.tokens) // page_size) == expect
    with pytest.raises(ValueError, match="page_keys"):
        live.page_keys(page_size, len(live.tokens) // page_size + 1)
    with pytest.raises(ValueError, match="page_keys"):
        live.page_key(page_size, len(live.tokens) // page_size)
