"""Pages of tokens and their chained 64-bit keys.

A request's tokens are cut into pages of ``page_size`` tokens. Every *full* page gets a key
``k_i = H(k_{i-1}, tokens of page i)`` with ``k_{-1}`` a namespace seed, so a key names the whole
prefix up to the end of its page: equal prefixes give equal keys (which is what lets the cache
share pages across requests), and two namespaces (model, tenant) start from different seeds, so
their keys coincide only by 64-bit chance. A partial trailing page has no key because its contents
can still grow.

A page's key is XXH64 of its tokens as 64-bit lanes (one lane per token), seeded with the
previous key, which gives the tests an independent oracle (the `xxhash` package). XXH64's four
independent accumulators let the kernel overlap its multiplies. Every accumulator update is a
bijection, so for a fixed prefix a change of any single token changes its page's accumulators and,
short of a 64-bit collision, the key of its page and of every page after it.

Token values are taken modulo 2**64 as two's-complement bit patterns: signed dtypes are
sign-extended and unsigned ones zero-extended, so the same values as int32 or int64 give the
same keys.

All validation errors are ``ValueError`` (one exception type for callers), and each message
names the offending argument.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

import numba
import numpy as np
import numpy.typing as npt

__all__ = [
    "MAX_SEED",
    "KeyArray",
    "TokenLike",
    "block_page_keys",
    "extend_page_keys",
    "namespace_seed",
    "next_page_key",
    "num_full_pages",
    "page_keys",
    "page_keys_reference",
    "paginate",
]

MAX_SEED: Final[int] = 2**64 - 1
"""Largest valid seed; seeds (and keys, read as Python ints) lie in [0, 2**64)."""

_MASK64: Final[int] = 2**64 - 1

KeyArray: TypeAlias = npt.NDArray[np.uint64]
TokenLike: TypeAlias = npt.NDArray[np.integer[Any]] | Sequence[int]

# xxhash64's primes. The Python ints drive the reference twin; the np.uint64 copies are frozen
# into the numba kernels as constants (numba would otherwise type them as int64 or float64).
_P1_INT: Final[int] = 11400714785074694791
_P2_INT: Final[int] = 14029467366897019727
_P3_INT: Final[int] = 1609587929392839161
_P4_INT: Final[int] = 9650029242287828579
_P5_INT: Final[int] = 2870177450012600261
# Added to the start of every block-derived key so that it never follows the same path as a
# token-derived key on the same seed ("blockkey" in ASCII).
_BLOCK_DOMAIN_INT: Final[int] = 0x626C6F636B6B6579

_P1 = np.uint64(_P1_INT)
_P2 = np.uint64(_P2_INT)
_P3 = np.uint64(_P3_INT)
_P4 = np.uint64(_P4_INT)
_P5 = np.uint64(_P5_INT)
_BLOCK_DOMAIN = np.uint64(_BLOCK_DOMAIN_INT)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / the golden ratio, odd
_U64_1 = np.uint64(1)
_U64_7 = np.uint64(7)
_U64_12 = np.uint64(12)
_U64_18 = np.uint64(18)
_U64_64 = np.uint64(64)
_U64_27 = np.uint64(27)
_U64_29 = np.uint64(29)
_U64_31 = np.uint64(31)
_U64_32 = np.uint64(32)
_U64_33 = np.uint64(33)
_U64_64_MINUS_27 = np.uint64(64 - 27)
_U64_64_MINUS_31 = np.uint64(64 - 31)

_NAMESPACE_PERSON: Final[bytes] = b"hicache-ns-v1"


# --------------------------------------------------------------------------------------------
# Namespaces and page arithmetic
# --------------------------------------------------------------------------------------------


def _len_prefixed(data: bytes) -> bytes:
    """Length-prefix a field so that concatenated fields can never be re-split differently."""
    return len(data).to_bytes(8, "little") + data


def namespace_seed(model: str, tenant: str | None = None) -> int:
    """Derive the 64-bit chain seed of a namespace so that namespaces never share page keys.

    The encoding is unambiguous: both fields are length-prefixed, and the tenant carries a
    presence tag, so ``("ab", "c")`` differs from ``("a", "bc")`` and ``tenant=None`` differs
    from ``tenant=""``.
    """
    if not isinstance(model, str):
        raise ValueError(f"model must be a str, got {type(model).__name__}")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError(f"tenant must be a str or None, got {type(tenant).__name__}")
    payload = _len_prefixed(model.encode("utf-8"))
    if tenant is None:
        payload += b"\x00"
    else:
        payload += b"\x01" + _len_prefixed(tenant.encode("utf-8"))
    digest = hashlib.blake2b(payload, digest_size=8, person=_NAMESPACE_PERSON).digest()
    return int.from_bytes(digest, "little")


def _check_count(value: object, name: str, minimum: int) -> int:
    """Accept only true integers (not bools or floats) so a unit mix-up fails loudly."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got bool {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"{name} must be an integer >= {minimum}, got {type(value).__name__} {value!r}"
        ) from None
    if number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {number}")
    return number


def _check_seed(seed: object) -> int:
    """Seeds are full 64-bit unsigned values; anything outside would be silently truncated."""
    if isinstance(seed, bool):
        raise ValueError(f"seed must be an int in [0, 2**64), got bool {seed!r}")
    try:
        number = operator.index(seed)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"seed must be an int in [0, 2**64), got {type(seed).__name__}") from None
    if not 0 <= number <= MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**64), got {number}")
    return number


def num_full_pages(num_tokens: int, page_size: int) -> int:
    """Number of full pages in ``num_tokens`` tokens (only full pages are keyed and cached)."""
    num_tokens = _check_count(num_tokens, "num_tokens", 0)
    page_size = _check_count(page_size, "page_size", 1)
    return num_tokens // page_size


def paginate(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """View the full pages of ``tokens`` as a ``(num_full_pages, page_size)`` array, tail dropped.

    It is a view (no copy), so callers can look at page contents without paying for them.
    """
    if not isinstance(tokens, np.ndarray):
        raise ValueError(f"tokens must be a numpy ndarray, got {type(tokens).__name__}")
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got an array of shape {tokens.shape}")
    page_size = _check_count(page_size, "page_size", 1)
    n_pages = tokens.shape[0] // page_size
    # Splitting the single axis of a (possibly strided) 1-D array into two never needs a copy.
    return tokens[: n_pages * page_size].reshape(n_pages, page_size)


def _as_lane_vector(values: object, name: str) -> np.ndarray:
    """Normalise ``values`` to a native 1-D int32 or int64 array holding the same 64-bit lanes.

    int32 and int64 pass through untouched (the kernels sign-extend int32 themselves), so the
    common case costs no copy. Other integer dtypes are widened to int64, which sign-extends
    signed and zero-extends unsigned values; uint64 is reinterpreted bit for bit.
    """
    if isinstance(values, np.ndarray):
        arr = values
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"{name} must be a 1-D sequence of integers: {exc}") from None
        if arr.ndim == 1 and arr.size == 0:
            arr = np.empty(0, dtype=np.int64)  # np.asarray([]) is float64
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got an array of shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"{name} must have an integer dtype (e.g. int32 or int64), got dtype {arr.dtype}"
            + (" (values that do not fit in 64 bits?)" if arr.dtype.kind == "O" else "")
        )
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.dtype == np.int32 or arr.dtype == np.int64:
        return arr
    if arr.dtype == np.uint64:
        return arr.view(np.int64)
    return arr.astype(np.int64)


# --------------------------------------------------------------------------------------------
# numba kernels. Every operand is an explicit np.uint64: numba promotes int64 (x) uint64 to
# float64, which would silently destroy the hash.
# --------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _lane_round(lane: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """Spread one 64-bit lane: multiply, rotate left 31, multiply (xxhash64's round)."""
    k = lane * _P2
    k = (k << _U64_31) | (k >> _U64_64_MINUS_31)
    return k * _P1


@numba.njit(cache=True, nogil=True)
def _merge_lane(acc: np.uint64, lane: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """Fold one lane into the accumulator; a bijection of ``acc`` for every lane."""
    acc = acc ^ _lane_round(lane)
    acc = (acc << _U64_27) | (acc >> _U64_64_MINUS_27)
    return acc * _P1 + _P4


@numba.njit(cache=True, nogil=True)
def _avalanche(acc: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """Finish a page so that every input bit affects every key bit (xxhash64's avalanche)."""
    acc = acc ^ (acc >> _U64_33)
    acc = acc * _P2
    acc = acc ^ (acc >> _U64_29)
    acc = acc * _P3
    return acc ^ (acc >> _U64_32)


@numba.njit(cache=True, nogil=True)
def _rotl(x: np.uint64, r: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    return (x << r) | (x >> (_U64_64 - r))


@numba.njit(cache=True, nogil=True)
def _stripe_round(acc: np.uint64, lane: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """One of XXH64's four parallel accumulators takes one lane."""
    return _rotl(acc + lane * _P2, _U64_31) * _P1


@numba.njit(cache=True, nogil=True)
def _page_keys_kernel(tokens: np.ndarray, page_size: np.int64, seed: np.uint64) -> np.ndarray:
    """XXH64 of every full page's int64 lanes, seeded by the previous page's key. Pages of 4 or
    more tokens run XXH64's four independent accumulators, so the multiplies overlap instead of
    waiting on each other; the chain across pages is inherently sequential."""
    n_pages = tokens.shape[0] // page_size
    out = np.empty(n_pages, dtype=np.uint64)
    nbytes = np.uint64(8 * page_size)
    stripes = page_size // 4
    prev = np.uint64(seed)
    i = 0
    for p in range(n_pages):
        end = i + page_size
        if stripes:
            v1 = prev + _P1 + _P2
            v2 = prev + _P2
            v3 = prev
            v4 = prev - _P1
            for _ in range(stripes):
                # int32 -> int64 sign-extends; int64 -> uint64 keeps the bit pattern.
                v1 = _stripe_round(v1, np.uint64(np.int64(tokens[i])))
                v2 = _stripe_round(v2, np.uint64(np.int64(tokens[i + 1])))
                v3 = _stripe_round(v3, np.uint64(np.int64(tokens[i + 2])))
                v4 = _stripe_round(v4, np.uint64(np.int64(tokens[i + 3])))
                i += 4
            h = _rotl(v1, _U64_1) + _rotl(v2, _U64_7) + _rotl(v3, _U64_12) + _rotl(v4, _U64_18)
            h = (h ^ _lane_round(v1)) * _P1 + _P4
            h = (h ^ _lane_round(v2)) * _P1 + _P4
            h = (h ^ _lane_round(v3)) * _P1 + _P4
            h = (h ^ _lane_round(v4)) * _P1 + _P4
        else:
            h = prev + _P5
        h = h + nbytes
        while i < end:
            h = _merge_lane(h, np.uint64(np.int64(tokens[i])))
            i += 1
        prev = _avalanche(h)
        out[p] = prev
    return out


@numba.njit(cache=True, nogil=True)
def _block_page_keys_kernel(
    block_ids: np.ndarray,
    block_size: np.int64,
    page_size: np.int64,
    n_pages: np.int64,
    seed: np.uint64,
    total_pages: np.int64,
    private_base: np.uint64,
) -> np.ndarray:
    """Key page j by (seed, block id of its last token, that token's offset in the block);
    pages from `n_pages` to `total_pages` get private keys (see `_private_into`)."""
    out = np.empty(max(n_pages, total_pages), dtype=np.uint64)
    start = np.uint64(seed) + _P5 + _BLOCK_DOMAIN
    for j in range(n_pages):
        last = (j + 1) * page_size - 1
        block = np.uint64(np.int64(block_ids[last // block_size]))
        offset = np.uint64(last % block_size)
        acc = _merge_lane(start, block)
        acc = _merge_lane(acc, offset)
        out[j] = _avalanche(acc)
    _private_into(out, n_pages, n_pages, private_base)
    return out


@numba.njit(cache=True, nogil=True)
def _private_into(out: np.ndarray, start: np.int64, first_page: np.int64, base: np.uint64) -> None:
    """`out[start:]` = the private keys of pages `first_page`, `first_page + 1`, ...: page i
    gets (i + 1) * golden ^ base (modulo 2**64), a bijection of i, so no two pages of one base
    share a key."""
    for j in range(start, out.size):
        out[j] = (np.uint64(first_page + j - start) + np.uint64(1)) * _GOLDEN ^ base


# --------------------------------------------------------------------------------------------
# Public key functions
# --------------------------------------------------------------------------------------------


def page_keys(tokens: TokenLike, page_size: int, seed: int) -> KeyArray:
    """Chained 64-bit keys of the full pages of ``tokens``, one ``np.uint64`` per full page.

    ``tokens`` is a 1-D integer numpy array (int32 and int64 are hashed without a copy) or a
    sequence of ints. The partial tail page, if any, gets no key.
    """
    arr = _as_lane_vector(tokens, "tokens")
    page_size = _check_count(page_size, "page_size", 1)
    seed = _check_seed(seed)
    return _page_keys_kernel(arr, np.int64(page_size), np.uint64(seed))


def next_page_key(prev: int, page: TokenLike) -> int:
    """The key of one more page: ``page``'s tokens (a whole page) chained on ``prev``, the key
    of the page before it or, for the first page, the seed.

    Equal by construction to the last of ``page_keys`` over the whole sequence, since the chain
    carries nothing from page to page but the previous key: a sequence growing a page at a time
    pays for the new page only, not for its whole prefix again.
    """
    arr = _as_lane_vector(page, "page")
    if arr.shape[0] == 0:
        raise ValueError("page must hold at least one token")
    return int(_page_keys_kernel(arr, np.int64(arr.shape[0]), np.uint64(_check_seed(prev)))[0])


def extend_page_keys(keys: list[int], new_tokens: TokenLike, page_size: int, seed: int) -> list[int]:
    """Append to ``keys`` (a sequence's first page keys, chained from ``seed``) the keys of the
    full pages of ``new_tokens``, the tokens that follow those pages; returns ``keys``.

    Only the new pages are hashed, so a sequence keyed as it grows costs one pass over its
    tokens in all; the result equals ``page_keys`` of the whole sequence (the chain carries
    nothing from page to page but the previous key).
    """
    prev = keys[-1] if keys else seed
    keys += page_keys(new_tokens, page_size, prev).tolist()
    return keys


def _merge_lane_py(acc: int, lane: int) -> int:
    """Pure-Python twin of ``_merge_lane`` on ints masked to 64 bits."""
    k = (lane * _P2_INT) & _MASK64
    k = ((k << 31) | (k >> 33)) & _MASK64
    k = (k * _P1_INT) & _MASK64
    acc ^= k
    acc = ((acc << 27) | (acc >> 37)) & _MASK64
    return (acc * _P1_INT + _P4_INT) & _MASK64


def _avalanche_py(acc: int) -> int:
    """Pure-Python twin of ``_avalanche``."""
    acc ^= acc >> 33
    acc = (acc * _P2_INT) & _MASK64
    acc ^= acc >> 29
    acc = (acc * _P3_INT) & _MASK64
    return acc ^ (acc >> 32)


def _rotl_py(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK64


def _stripe_round_py(acc: int, lane: int) -> int:
    return (_rotl_py((acc + lane * _P2_INT) & _MASK64, 31) * _P1_INT) & _MASK64


def page_keys_reference(tokens: TokenLike, page_size: int, seed: int) -> list[int]:
    """Bit-identical pure-Python twin of :func:`page_keys`: the readable statement of the hash.

    Page i's key is XXH64 of the page's tokens as little-endian int64 lanes, seeded with
    ``k_{i-1}`` (``k_{-1}`` = seed), all arithmetic modulo 2**64::

        if P >= 4:  four accumulators v1..v4 = k + P1 + P2, k + P2, k, k - P1 take the lanes in
                    turn (v = rotl(v + t * P2, 31) * P1); h = rotl(v1, 1) + rotl(v2, 7)
                    + rotl(v3, 12) + rotl(v4, 18), then each v is merged into h
        else:       h = k + P5
        h += 8 * P; the remaining P mod 4 lanes: h = rotl(h ^ round(t), 27) * P1 + P4
        k_i = avalanche(h)
    """
    arr = _as_lane_vector(tokens, "tokens")
    page_size = _check_count(page_size, "page_size", 1)
    prev = _check_seed(seed)
    lanes = [int(t) & _MASK64 for t in arr.tolist()]
    keys: list[int] = []
    stripes = page_size // 4
    for start in range(0, len(lanes) - page_size + 1, page_size):
        page = lanes[start : start + page_size]
        if stripes:
            v = [
                (prev + _P1_INT + _P2_INT) & _MASK64,
                (prev + _P2_INT) & _MASK64,
                prev,
                (prev - _P1_INT) & _MASK64,
            ]
            for j in range(stripes * 4):
                v[j % 4] = _stripe_round_py(v[j % 4], page[j])
            h = (_rotl_py(v[0], 1) + _rotl_py(v[1], 7) + _rotl_py(v[2], 12) + _rotl_py(v[3], 18)) & _MASK64
            for x in v:
                h = ((h ^ _stripe_round_py(0, x)) * _P1_INT + _P4_INT) & _MASK64
        else:
            h = (prev + _P5_INT) & _MASK64
        h = (h + 8 * page_size) & _MASK64
        for lane in page[stripes * 4 :]:
            h = _merge_lane_py(h, lane)
        prev = _avalanche_py(h)
        keys.append(prev)
    return keys


def block_page_keys(
    block_ids: TokenLike,
    block_size: int,
    page_size: int,
    num_tokens: int,
    seed: int,
) -> KeyArray:
    """Page keys for a trace that gives chained block ids instead of token ids.

    Traces such as Mooncake's give one id per ``block_size`` tokens, and an id names the whole
    prefix through its block (the last block may be partial). Page j, covering tokens
    ``[j*P, (j+1)*P)``, is keyed by a mix of (seed, id of the block holding its last token e,
    ``e % block_size``): since ids are chained, that pair names the prefix ``[0, e]`` uniquely,
    whatever the ratio of ``page_size`` to ``block_size``. A consequence worth knowing: the key
    of the prefix ``[0, e]`` does not depend on ``page_size``. Only full pages get keys.
    """
    return block_sequence_keys(block_ids, block_size, page_size, num_tokens, 0, seed, 0)


def block_sequence_keys(
    block_ids: TokenLike,
    block_size: int,
    page_size: int,
    num_tokens: int,
    total_pages: int,
    seed: int,
    private_base: int,
) -> KeyArray:
    """`block_page_keys` of the first `num_tokens`, then, up to `total_pages`, keys that belong
    to one sequence alone (`private_page_keys` of `private_base`): a trace request's prompt and
    output in one call, as a replay needs them for every request."""
    arr = _as_lane_vector(block_ids, "block_ids")
    block_size = _check_count(block_size, "block_size", 1)
    page_size = _check_count(page_size, "page_size", 1)
    num_tokens = _check_count(num_tokens, "num_tokens", 0)
    total_pages = _check_count(total_pages, "total_pages", 0)
    seed = _check_seed(seed)
    private_base = _check_seed(private_base)
    expected = -(-num_tokens // block_size)
    if arr.shape[0] != expected:
        raise ValueError(
            f"block_ids has {arr.shape[0]} ids but num_tokens={num_tokens} at "
            f"block_size={block_size} needs ceil({num_tokens}/{block_size}) = {expected}"
        )
    n_pages = num_tokens // page_size
    return _block_page_keys_kernel(
        arr,
        np.int64(block_size),
        np.int64(page_size),
        np.int64(n_pages),
        np.uint64(seed),
        np.int64(total_pages),
        np.uint64(private_base),
    )


def private_page_keys(base: int, start: int, stop: int) -> KeyArray:
    """Keys of pages [start, stop) of a sequence that shares none of them: page i gets
    (i + 1) * 0x9E3779B97F4A7C15 ^ base, modulo 2**64."""
    start = _check_count(start, "start", 0)
    stop = max(start, _check_count(stop, "stop", 0))
    out = np.empty(stop - start, dtype=np.uint64)
    _private_into(out, np.int64(0), np.int64(start), np.uint64(_check_seed(base)))
    return out
