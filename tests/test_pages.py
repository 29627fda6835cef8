"""Behaviour of pages and chained page keys (hicache.core.pages)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.core.pages import (
    MAX_SEED,
    block_page_keys,
    namespace_seed,
    num_full_pages,
    page_keys,
    page_keys_reference,
    paginate,
)

try:
    import xxhash
except ImportError:  # the oracle tests are skipped, the rest still run
    xxhash = None
needs_xxhash = pytest.mark.skipif(xxhash is None, reason="xxhash is not installed")

SETTINGS = settings(max_examples=examples(120), deadline=None)
seeds = st.integers(0, MAX_SEED)
page_sizes = st.integers(1, 17)


@st.composite
def token_arrays(draw: st.DrawFn, min_len: int = 0, max_len: int = 300) -> np.ndarray:
    """Int32 or int64 token arrays over the dtype's full range, so sign handling is exercised."""
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    info = np.iinfo(dtype)
    values = draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=min_len, max_size=max_len))
    return np.array(values, dtype=dtype)


def as_ints(keys: np.ndarray) -> list[int]:
    return [int(k) for k in keys]


def xxh64_chain(pages: np.ndarray, seed: int) -> list[int]:
    """Independent oracle: every key is XXH64 of its page's int64 lanes, seeded by the previous key."""
    keys, prev = [], seed
    for page in pages:
        prev = xxhash.xxh64_intdigest(page.astype("<i8").tobytes(), seed=prev)
        keys.append(prev)
    return keys


# ---------------------------------------------------------------------------------------------
# page_keys: kernel vs reference vs oracle
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(tokens=token_arrays(), page_size=page_sizes, seed=seeds)
def test_numba_kernel_matches_pure_python_reference(tokens: np.ndarray, page_size: int, seed: int) -> None:
    keys = page_keys(tokens, page_size, seed)
    assert keys.dtype == np.uint64
    assert keys.shape == (len(tokens) // page_size,)
    assert as_ints(keys) == page_keys_reference(tokens, page_size, seed)


@needs_xxhash
@SETTINGS
@given(tokens=token_arrays(max_len=200), page_size=st.integers(1, 40), seed=seeds)
def test_keys_are_exactly_chained_xxh64(tokens: np.ndarray, page_size: int, seed: int) -> None:
    expected = xxh64_chain(paginate(tokens, page_size), seed)
    assert as_ints(page_keys(tokens, page_size, seed)) == expected
    assert page_keys_reference(tokens, page_size, seed) == expected


def test_golden_keys_are_stable() -> None:
    """Keys may be persisted (e.g. in a remote store), so the function must not drift silently."""
    assert as_ints(page_keys(np.arange(8, dtype=np.int64), 4, 0)) == [0xD5FE80BD05F87C8E, 0x42352C583876B61E]
    assert namespace_seed("m") == 0x1F54EE59CB156F39
    assert namespace_seed("m", "t") == 0xE85158E72D8DECB8


# ---------------------------------------------------------------------------------------------
# Chain and prefix properties
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(data=st.data(), tokens=token_arrays(min_len=1), page_size=page_sizes, seed=seeds)
def test_one_token_edit_changes_exactly_the_keys_from_its_page_on(
    data: st.DataObject, tokens: np.ndarray, page_size: int, seed: int
) -> None:
    n_pages = len(tokens) // page_size
    if n_pages == 0:
        tokens = np.resize(tokens, page_size)
        n_pages = 1
    pos = data.draw(st.integers(0, n_pages * page_size - 1), label="pos")
    info = np.iinfo(tokens.dtype)
    new = data.draw(st.integers(int(info.min), int(info.max)).filter(lambda v: v != int(tokens[pos])))
    edited = tokens.copy()
    edited[pos] = new
    before, after = page_keys(tokens, page_size, seed), page_keys(edited, page_size, seed)
    page = pos // page_size
    assert np.array_equal(before[:page], after[:page])
    assert np.all(before[page:] != after[page:])


@SETTINGS
@given(prefix=token_arrays(max_len=120), page_size=page_sizes, seed=seeds, data=st.data())
def test_shared_prefix_gives_equal_keys_up_to_the_divergent_page(
    prefix: np.ndarray, page_size: int, seed: int, data: st.DataObject
) -> None:
    info = np.iinfo(prefix.dtype)
    tail_a = data.draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1, max_size=60))
    tail_b = data.draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1, max_size=60))
    if tail_b[0] == tail_a[0]:
        tail_b[0] = tail_a[0] + 1 if tail_a[0] < info.max else tail_a[0] - 1
    a = np.concatenate([prefix, np.array(tail_a, dtype=prefix.dtype)])
    b = np.concatenate([prefix, np.array(tail_b, dtype=prefix.dtype)])
    ka, kb = page_keys(a, page_size, seed), page_keys(b, page_size, seed)
    shared = len(prefix) // page_size  # pages wholly inside the common prefix
    assert np.array_equal(ka[:shared], kb[:shared])
    # The page holding the first difference differs, and so does everything chained after it.
    common = min(len(ka), len(kb))
    assert np.all(ka[shared:common] != kb[shared:common])


def test_equal_prefixes_give_equal_keys_and_extension_keeps_them() -> None:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 128_000, 1000, dtype=np.int32)
    keys = page_keys(tokens, 16, 99)
    assert np.array_equal(page_keys(tokens.copy(), 16, 99), keys)
    for cut in (0, 15, 16, 17, 500, 999):
        assert np.array_equal(page_keys(tokens[:cut], 16, 99), keys[: cut // 16])


def test_within_a_request_page_keys_are_distinct_even_for_repeated_pages() -> None:
    tokens = np.tile(np.arange(8, dtype=np.int64), 50)  # the same page content 50 times
    keys = page_keys(tokens, 8, 1)
    assert len(set(as_ints(keys))) == 50


def test_different_tenants_give_disjoint_keys_on_the_same_tokens() -> None:
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 32_000, 8192, dtype=np.int32)
    seeds_ = [
        namespace_seed("llama-3-70b"),
        namespace_seed("llama-3-70b", "a"),
        namespace_seed("llama-3-70b", "b"),
    ]
    key_sets = [set(as_ints(page_keys(tokens, 16, s))) for s in seeds_]
    assert all(len(ks) == 512 for ks in key_sets)
    assert not key_sets[0] & key_sets[1]
    assert not key_sets[0] & key_sets[2]
    assert not key_sets[1] & key_sets[2]


def test_namespace_seed_is_unambiguous_and_in_range() -> None:
    values = {
        namespace_seed("ab", "c"),
        namespace_seed("a", "bc"),
        namespace_seed("abc"),
        namespace_seed("abc", ""),
        namespace_seed("ab"),
        namespace_seed("ab", None),
        namespace_seed("other", "c"),
    }
    # ("ab", None) and ("ab",) are the same namespace; everything else must differ.
    assert len(values) == 6
    assert namespace_seed("m", "t") == namespace_seed("m", "t")
    assert namespace_seed("", None) != namespace_seed("", "")
    assert all(0 <= v <= MAX_SEED for v in values)


# ---------------------------------------------------------------------------------------------
# Input forms
# ---------------------------------------------------------------------------------------------


def test_int32_int64_list_uint_and_strided_inputs_agree() -> None:
    rng = np.random.default_rng(11)
    values = rng.integers(-(2**31), 2**31, 999, dtype=np.int64)
    expected = page_keys(values, 9, 5)
    assert np.array_equal(page_keys(values.astype(np.int32), 9, 5), expected)
    assert np.array_equal(page_keys(values.tolist(), 9, 5), expected)
    assert np.array_equal(page_keys(values.astype(">i4"), 9, 5), expected)  # non-native byte order
    # Same 64-bit pattern as uint64; a strided view hashes like its contiguous copy.
    assert np.array_equal(page_keys(values.view(np.uint64), 9, 5), expected)
    doubled = np.repeat(values, 2)[::2]
    assert not doubled.flags.c_contiguous
    assert np.array_equal(page_keys(doubled, 9, 5), expected)


def test_small_unsigned_dtypes_are_zero_extended_and_small_signed_sign_extended() -> None:
    assert np.array_equal(page_keys(np.array([255], dtype=np.uint8), 1, 0), page_keys([255], 1, 0))
    assert np.array_equal(page_keys(np.array([-1], dtype=np.int8), 1, 0), page_keys([-1], 1, 0))
    assert not np.array_equal(page_keys(np.array([2**32 - 1], dtype=np.uint32), 1, 0), page_keys([-1], 1, 0))


def test_partial_tail_page_gets_no_key() -> None:
    tokens = np.arange(3 * 10 + 7, dtype=np.int32)
    keys = page_keys(tokens, 10, 0)
    assert len(keys) == 3
    assert np.array_equal(keys, page_keys(tokens[:30], 10, 0))
    short = page_keys(tokens[:9], 10, 0)
    assert short.dtype == np.uint64 and short.shape == (0,)
    assert page_keys([], 4, 0).shape == (0,)
    assert page_keys_reference(tokens[:9], 10, 0) == []


def test_num_full_pages() -> None:
    assert [num_full_pages(n, 4) for n in (0, 3, 4, 5, 8, 9)] == [0, 0, 1, 1, 2, 2]
    assert num_full_pages(7, 1) == 7
    with pytest.raises(ValueError, match="num_tokens"):
        num_full_pages(-1, 4)
    with pytest.raises(ValueError, match="page_size"):
        num_full_pages(4, 0)


def test_paginate_is_a_view_of_the_full_pages() -> None:
    tokens = np.arange(23, dtype=np.int32)
    pages = paginate(tokens, 5)
    assert pages.shape == (4, 5)
    assert np.shares_memory(pages, tokens)
    assert np.array_equal(pages[2], [10, 11, 12, 13, 14])
    pages[0, 0] = -7
    assert tokens[0] == -7  # writes go through: no copy was made
    strided = np.arange(40, dtype=np.int64)[::2]
    assert np.shares_memory(paginate(strided, 3), strided)
    assert np.array_equal(paginate(strided, 3)[1], [6, 8, 10])
    assert paginate(tokens[:4], 5).shape == (0, 5)


# ---------------------------------------------------------------------------------------------
# block_page_keys (trace block ids -> page keys)
# ---------------------------------------------------------------------------------------------

BLOCK = 512


def test_page_size_equal_to_block_size_gives_one_key_per_full_block() -> None:
    ids = [10, 11, 12, 13, 14, 15]
    keys = block_page_keys(ids, BLOCK, BLOCK, 5 * BLOCK + 100, 1)
    assert keys.dtype == np.uint64 and len(keys) == 5
    assert len(set(as_ints(keys))) == 5
    # Exactly full: the last block is full, so it gets a key too.
    assert len(block_page_keys(ids, BLOCK, BLOCK, 6 * BLOCK, 1)) == 6


def test_page_size_an_eighth_of_block_size_gives_eight_keys_per_full_block() -> None:
    tail = 200
    keys = block_page_keys([1, 2, 3, 4], BLOCK, BLOCK // 8, 3 * BLOCK + tail, 1)
    assert len(keys) == 3 * 8 + tail // (BLOCK // 8)
    assert len(set(as_ints(keys))) == len(keys)


@pytest.mark.parametrize("page_size", [1, 64, 96, 512, 700, 1024, 2048])
@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_requests_sharing_k_block_ids_share_exactly_the_pages_inside_those_blocks(
    page_size: int, k: int
) -> None:
    num_tokens = 5 * BLOCK - 37  # the last block is partial
    ids_a = [101, 102, 103, 104, 105]
    ids_b = ids_a[:k] + [900 + i for i in range(5 - k)]
    ka = block_page_keys(ids_a, BLOCK, page_size, num_tokens, 42)
    kb = block_page_keys(ids_b, BLOCK, page_size, num_tokens, 42)
    assert len(ka) == len(kb) == num_tokens // page_size
    shared = min(k * BLOCK, num_tokens) // page_size  # pages wholly inside the shared blocks
    assert np.array_equal(ka[:shared], kb[:shared])
    assert np.all(ka[shared:] != kb[shared:])


def test_page_size_larger_than_block_size() -> None:
    keys = block_page_keys([5, 6, 7, 8, 9, 10, 11], 16, 40, 100, 3)
    assert len(keys) == 2
    # Page 0 ends at token 39 (block 2, offset 7), page 1 at token 79 (block 4, offset 15).
    assert as_ints(keys) == as_ints(block_page_keys([5, 6, 7, 8, 9, 10, 11], 16, 1, 100, 3)[[39, 79]])


@SETTINGS
@given(
    block_size=st.integers(1, 40),
    page_size=st.integers(1, 100),
    num_tokens=st.integers(0, 400),
    seed=seeds,
    data=st.data(),
)
def test_block_key_names_the_prefix_through_its_last_token_whatever_the_page_size(
    block_size: int, page_size: int, num_tokens: int, seed: int, data: st.DataObject
) -> None:
    n_blocks = -(-num_tokens // block_size)
    ids = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n_blocks, max_size=n_blocks))
    per_token = block_page_keys(ids, block_size, 1, num_tokens, seed)
    keys = block_page_keys(ids, block_size, page_size, num_tokens, seed)
    ends = np.arange(1, num_tokens // page_size + 1) * page_size - 1
    assert np.array_equal(keys, per_token[ends])


@needs_xxhash
def test_block_keys_match_an_xxh64_oracle() -> None:
    seed, ids = namespace_seed("m"), [77, -5, 2**40]
    keys = block_page_keys(ids, 8, 3, 20, seed)
    domain = int.from_bytes(b"blockkey", "big")
    # Key = XXH64 over the two int64 lanes (block id, offset) with the domain-shifted seed.
    expected = []
    for j in range(20 // 3):
        last = (j + 1) * 3 - 1
        lanes = np.array([ids[last // 8], last % 8], dtype="<i8").tobytes()
        expected.append(xxhash.xxh64_intdigest(lanes, seed=(seed + domain - 16) % 2**64))
    assert as_ints(keys) == expected


def test_block_ids_count_must_match_num_tokens() -> None:
    with pytest.raises(ValueError, match=r"block_ids has 2 ids .* needs .* = 3"):
        block_page_keys([1, 2], BLOCK, 64, 2 * BLOCK + 1, 0)
    with pytest.raises(ValueError, match="block_ids"):
        block_page_keys([1, 2, 3], BLOCK, 64, 2 * BLOCK, 0)
    assert block_page_keys([], BLOCK, 64, 0, 0).shape == (0,)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: page_keys(np.arange(8), 0, 0), "page_size"),
        (lambda: page_keys(np.arange(8), -3, 0), "page_size"),
        (lambda: page_keys(np.arange(8), 2.5, 0), "page_size"),
        (lambda: page_keys(np.arange(8), True, 0), "page_size"),
        (lambda: page_keys(np.zeros((2, 4), dtype=np.int64), 2, 0), "tokens"),
        (lambda: page_keys(np.zeros(8, dtype=np.float32), 2, 0), "tokens"),
        (lambda: page_keys(np.zeros(8, dtype=bool), 2, 0), "tokens"),
        (lambda: page_keys([1.5, 2.0], 1, 0), "tokens"),
        (lambda: page_keys([2**70], 1, 0), "tokens"),
        (lambda: page_keys(np.int64(3), 1, 0), "tokens"),
        (lambda: page_keys(np.arange(8), 2, -1), "seed"),
        (lambda: page_keys(np.arange(8), 2, 2**64), "seed"),
        (lambda: page_keys(np.arange(8), 2, 1.0), "seed"),
        (lambda: page_keys_reference(np.arange(8), 0, 0), "page_size"),
        (lambda: page_keys_reference(np.zeros(8, dtype=np.float64), 2, 0), "tokens"),
        (lambda: paginate(np.zeros((2, 4)), 2), "tokens"),
        (lambda: paginate(np.arange(8), 0), "page_size"),
        (lambda: block_page_keys([1], 0, 64, 10, 0), "block_size"),
        (lambda: block_page_keys([1], 512, 0, 10, 0), "page_size"),
        (lambda: block_page_keys([1], 512, 64, -1, 0), "num_tokens"),
        (lambda: block_page_keys([[1]], 512, 64, 10, 0), "block_ids"),
        (lambda: block_page_keys([1.0], 512, 64, 10, 0), "block_ids"),
        (lambda: block_page_keys([1], 512, 64, 10, 2**64), "seed"),
        (lambda: namespace_seed(b"model"), "model"),
        (lambda: namespace_seed("model", 3), "tenant"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_the_argument(
    call: Callable[[], object], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        call()
