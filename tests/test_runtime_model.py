"""The runtime's tiny transformer: determinism, incremental == monolithic K/V, exact paging, causality."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_helpers import one_thread, rel_err  # noqa: F401  (a fixture)

from hicache.runtime.model.llama import TinyConfig, TinyModel, from_pages, greedy_token, to_pages

CONFIG = TinyConfig()
MODEL = TinyModel(CONFIG)


pytestmark = pytest.mark.usefixtures("one_thread")


def random_tokens(n: int, seed: int, vocab: int = CONFIG.vocab) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float64 tensor: equality here means an exact copy, NaN and -0.0 included."""
    return t.contiguous().view(torch.int64)


# -- determinism --------------------------------------------------------------------------------


def test_same_config_gives_bit_identical_models() -> None:
    other = TinyModel(TinyConfig())
    mine, theirs = MODEL.parameters(), other.parameters()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    tokens = random_tokens(97, seed=3)
    kv_a, logits_a = MODEL.forward(tokens)
    kv_b, logits_b = other.forward(tokens)
    assert torch.equal(kv_a, kv_b)
    assert torch.equal(logits_a, logits_b)
    assert torch.equal(MODEL.generate(tokens, 5)[0], other.generate(tokens, 5)[0])


def test_different_seed_gives_a_different_model() -> None:
    other = TinyModel(attrs.evolve(CONFIG, seed=1))
    tokens = random_tokens(40, seed=4)
    kv_a, logits_a = MODEL.forward(tokens)
    kv_b, logits_b = other.forward(tokens)
    assert not torch.equal(kv_a, kv_b)
    assert not torch.equal(logits_a, logits_b)
    assert not torch.equal(MODEL.parameters()["embed"], other.parameters()["embed"])


def test_activations_stay_order_one() -> None:
    kv, logits = MODEL.forward(random_tokens(256, seed=5))
    assert 0.1 < float(kv.std()) < 10.0
    assert 0.1 < float(logits.std()) < 10.0
    assert torch.isfinite(kv).all() and torch.isfinite(logits).all()


# -- incremental equals monolithic --------------------------------------------------------------


@settings(max_examples=examples(100), deadline=None)
@given(
    length=st.integers(1, 300),
    split=st.floats(0.0, 1.0),
    page_size=st.integers(1, 64),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_paged_prefill_then_decode_matches_the_monolithic_pass(
    length: int, split: float, page_size: int, steps: int, seed: int
) -> None:
    tokens = random_tokens(length, seed)
    cut = max(1, min(length, round(split * length)))
    # The decode node's view: a restored prefix arrives as pages, the increment is computed on top.
    prefix_kv, token = MODEL.prefill(tokens[:cut])
    kv = from_pages(to_pages(prefix_kv, page_size), cut)
    if cut < length:
        increment_kv, token = MODEL.prefill(tokens[cut:], kv)
        kv = torch.cat((kv, increment_kv), dim=2)
    generated = []
    for _ in range(steps):
        generated.append(token)
        step_kv, token = MODEL.decode_step(token, kv)
        kv = torch.cat((kv, step_kv), dim=2)

    ref_tokens, ref_kv = MODEL.generate(tokens, steps)
    assert generated == ref_tokens.tolist()
    whole = torch.cat((tokens, ref_tokens))
    mono = MODEL.monolithic_kv(whole)
    assert kv.shape == mono.shape == CONFIG.kv_shape(length + steps)
    assert rel_err(kv, mono) < 1e-9
    assert rel_err(ref_kv, mono) < 1e-9
    # The first generated token is the greedy pick from one pass over the prompt.
    assert ref_tokens[0] == greedy_token(MODEL.forward(tokens)[1])


def test_generate_with_no_steps_is_the_prefill() -> None:
    tokens = random_tokens(33, seed=6)
    out, full_kv = MODEL.generate(tokens, 0)
    assert out.dtype == torch.int64 and out.shape == (0,)
    assert torch.equal(full_kv, MODEL.prefill(tokens)[0])


def test_explicit_past_len_must_agree_with_past_kv() -> None:
    tokens = random_tokens(20, seed=7)
    past, _ = MODEL.forward(tokens[:12])
    kv_a, logits_a = MODEL.forward(tokens[12:], past, 12)
    kv_b, logits_b = MODEL.forward(tokens[12:], past)
    assert torch.equal(kv_a, kv_b) and torch.equal(logits_a, logits_b)
    with pytest.raises(ValueError, match="past_len"):
        MODEL.forward(tokens[12:], past, 11)
    with pytest.raises(ValueError, match="past_len"):
        MODEL.forward(tokens[12:], None, 3)


def test_the_past_matters() -> None:
    tokens = random_tokens(30, seed=8)
    alone, _ = MODEL.forward(tokens[20:])
    after, _ = MODEL.forward(tokens[20:], MODEL.forward(tokens[:20])[0])
    assert not torch.equal(alone, after)


# -- what the cache holds -----------------------------------------------------------------------


@settings(max_examples=examples(20), deadline=None)
@given(length=st.integers(2, 120), data=st.data())
def test_changing_a_later_token_leaves_earlier_kv_untouched(length: int, data: st.DataObject) -> None:
    tokens = random_tokens(length, data.draw(st.integers(0, 2**31), label="seed"))
    pos = data.draw(st.integers(1, length - 1), label="pos")
    changed = tokens.clone()
    changed[pos] = (tokens[pos] + data.draw(st.integers(1, CONFIG.vocab - 1), label="shift")) % CONFIG.vocab
    kv_a, _ = MODEL.forward(tokens)
    kv_b, _ = MODEL.forward(changed)
    assert torch.equal(kv_a[:, :, :pos], kv_b[:, :, :pos])
    assert not torch.equal(kv_a[:, :, pos], kv_b[:, :, pos])


def test_cached_keys_are_rotated_by_position() -> None:
    # In the first layer K and V depend only on the token and (for K) its position, so the same
    # token at positions 0 and 1 has equal V and K rotated pairwise by RoPE: same pair norms.
    kv, _ = MODEL.forward(torch.tensor([7, 7], dtype=torch.int64))
    k0, k1 = kv[0, 0, 0], kv[0, 0, 1]
    assert torch.equal(kv[0, 1, 0], kv[0, 1, 1])
    assert not torch.allclose(k0, k1)
    half = CONFIG.head_dim // 2

    def pair_norms(k: torch.Tensor) -> torch.Tensor:
        return k[..., :half] ** 2 + k[..., half:] ** 2

    assert torch.allclose(pair_norms(k0), pair_norms(k1), rtol=1e-12, atol=0.0)


def test_logits_and_kv_shapes_and_dtypes() -> None:
    kv, logits = MODEL.forward(random_tokens(9, seed=9))
    assert kv.shape == (CONFIG.layers, 2, 9, CONFIG.kv_heads, CONFIG.head_dim)
    assert kv.dtype == logits.dtype == torch.float64
    assert logits.shape == (CONFIG.vocab,)
    small = TinyModel(TinyConfig(layers=3, q_heads=6, kv_heads=3, head_dim=8, vocab=50, dtype="float32"))
    kv, logits = small.forward(random_tokens(5, seed=10, vocab=50))
    assert kv.shape == (3, 2, 5, 3, 8)
    assert kv.dtype == logits.dtype == torch.float32
    assert logits.shape == (50,)


def test_greedy_ties_break_by_lowest_index() -> None:
    assert greedy_token(torch.tensor([0.0, 2.0, 1.0, 2.0], dtype=torch.float64)) == 1
    assert greedy_token(torch.tensor([3.0, 3.0], dtype=torch.float64)) == 0


# -- pages --------------------------------------------------------------------------------------


@settings(max_examples=examples(60), deadline=None)
@given(
    length=st.integers(0, 200),
    page_size=st.integers(1, 70),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    dim=st.integers(1, 5),
    seed=st.integers(0, 2**31),
)
def test_paging_round_trip_is_exact(
    length: int, page_size: int, layers: int, heads: int, dim: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((layers, 2, length, heads, dim), generator=gen, dtype=torch.float64)
    if length:
        kv.view(-1)[0] = float("nan")
        kv.view(-1)[-1] = -0.0
    pages = to_pages(kv, page_size)
    num_pages = math.ceil(length / page_size)
    assert pages.shape == (num_pages, layers, 2, page_size, heads, dim)
    for p in range(num_pages):
        start = p * page_size
        filled = min(page_size, length - start)
        assert torch.equal(bits(pages[p, :, :, :filled]), bits(kv[:, :, start : start + filled]))
        assert torch.equal(bits(pages[p, :, :, filled:]), bits(torch.zeros_like(pages[p, :, :, filled:])))
    back = from_pages(pages, length)
    assert back.shape == kv.shape
    assert torch.equal(bits(back), bits(kv))
    if length:
        back.view(-1)[0] = 1.0  # a fresh tensor: writing to it leaves the pages alone
        assert torch.isnan(pages.view(-1)[0])


def test_from_pages_takes_a_shorter_prefix_and_rejects_a_longer_one() -> None:
    kv, _ = MODEL.forward(random_tokens(10, seed=11))
    pages = to_pages(kv, 4)
    assert torch.equal(from_pages(pages, 6), kv[:, :, :6])
    with pytest.raises(ValueError, match=r"length: expected an integer in \[0, 12\]"):
        from_pages(pages, 13)
    with pytest.raises(ValueError, match="pages: expected shape"):
        from_pages(kv, 10)
    with pytest.raises(ValueError, match="page_size"):
        to_pages(kv, 0)
    with pytest.raises(ValueError, match="kv: expected shape"):
        to_pages(pages, 4)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"q_heads": 4, "kv_heads": 3}, "TinyConfig.q_heads"),
        ({"head_dim": 15}, "TinyConfig.head_dim"),
        ({"layers": 0}, "TinyConfig.layers"),
        ({"ffn": 2.5}, "TinyConfig.ffn"),
        ({"vocab": 1}, "TinyConfig.vocab"),
        ({"seed": -1}, "TinyConfig.seed"),
        ({"dtype": "bfloat16"}, "TinyConfig.dtype"),
        ({"rope_base": 1.0}, "TinyConfig.rope_base"),
    ],
)
def test_bad_config_names_the_field(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TinyConfig(**fields)  # type: ignore[arg-type]


def test_bad_forward_input_names_the_argument() -> None:
    past, _ = MODEL.forward(random_tokens(4, seed=12))
    with pytest.raises(ValueError, match="tokens: expected a non-empty"):
        MODEL.forward(torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="tokens: expected a non-empty"):
        MODEL.forward(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"tokens: expected ids in \[0, 512\), got 512"):
        MODEL.forward(torch.tensor([1, 512], dtype=torch.int64))
    with pytest.raises(ValueError, match="past_kv: expected shape"):
        MODEL.forward(random_tokens(2, seed=13), past[:, :, :, :1])
    with pytest.raises(ValueError, match="past_kv: expected shape"):
        MODEL.forward(random_tokens(2, seed=13), past.to(torch.float32))
    with pytest.raises(ValueError, match="n: expected"):
        MODEL.generate(random_tokens(2, seed=13), -1)
