"""Token sampling: greedy equals argmax, filters degenerate to greedy, batch-independent draws,
and sampled frequencies that follow the distribution."""

from __future__ import annotations

import math

import pytest
import torch
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.runtime.model.sampling import sample
from hicache.runtime.wire.sampling_fields import Sampling

GREEDY = Sampling()


def random_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn((batch, vocab), generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * 3


def test_greedy_is_argmax_with_ties_to_the_lowest_index() -> None:
    logits = random_logits(5, 100, seed=1)
    logits[2, 7] = logits[2, 40] = logits[2].max() + 1.0
    got = sample(logits, [GREEDY] * 5, [0] * 5)
    assert got == logits.argmax(dim=1).tolist()
    assert got[2] == 7


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**31), temperature=st.floats(0.05, 5.0), sampler_seed=st.integers(0, 2**40))
def test_top_k_one_and_a_tiny_top_p_are_greedy(seed: int, temperature: float, sampler_seed: int) -> None:
    logits = random_logits(4, 300, seed)
    want = logits.argmax(dim=1).tolist()
    top_k = Sampling(temperature=temperature, top_k=1, seed=sampler_seed)
    top_p = Sampling(temperature=temperature, top_p=1e-9, seed=sampler_seed)
    min_p = Sampling(temperature=temperature, min_p=0.999999, seed=sampler_seed)
    for params in (top_k, top_p, min_p):
        assert sample(logits, [params] * 4, [3, 4, 5, 6]) == want


def test_same_seed_and_position_give_the_same_token_in_any_batch() -> None:
    vocab = 64
    mine = random_logits(1, vocab, seed=2)[0] / 3  # flat enough that draws really vary
    params = Sampling(temperature=1.0, top_p=0.95, seed=1234)
    alone = [sample(mine[None], [params], [pos])[0] for pos in range(40)]
    assert len(set(alone)) > 5  # the position really moves the draw
    for batch_seed in range(5):
        others = random_logits(6, vocab, seed=100 + batch_seed)
        at = batch_seed % 7
        rows = torch.cat((others[:at], mine[None], others[at:]))
        neighbours = [Sampling(temperature=0.7, seed=batch_seed * 10 + i) for i in range(6)]
        batch_params = neighbours[:at] + [params] + neighbours[at:]
        for pos in range(40):
            positions = [pos + 1000 * i for i in range(7)]
            positions[at] = pos
            assert sample(rows, batch_params, positions)[at] == alone[pos]


def test_a_missing_seed_comes_from_the_request_key() -> None:
    logits = random_logits(2, 500, seed=3) / 3
    unseeded = Sampling(temperature=1.0)
    a = [sample(logits[:1], [unseeded], [p], request_keys=["req-a"])[0] for p in range(30)]
    again = [sample(logits[:1], [unseeded], [p], request_keys=["req-a"])[0] for p in range(30)]
    other = [sample(logits[:1], [unseeded], [p], request_keys=["req-b"])[0] for p in range(30)]
    assert a == again and a != other
    with pytest.raises(ValueError, match=r"params\[0\]: seed is None"):
        sample(logits[:1], [unseeded], [0])


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    logits = probs.log()[None].float()
    draws = 3000
    counts = [0, 0, 0]
    for seed in range(draws):
        counts[sample(logits, [Sampling(temperature=1.0, seed=seed)], [7])[0]] += 1
    # Three standard deviations of a binomial proportion at n=3000 is under 0.028.
    for want, got in zip(probs.tolist(), counts, strict=True):
        assert abs(got / draws - want) < 0.03, counts
    # A low temperature sharpens towards the top token; top_k=2 never picks the third.
    cold = sum(sample(logits, [Sampling(temperature=0.25, seed=s)], [7])[0] == 0 for s in range(draws // 3))
    assert cold / (draws // 3) > 0.8
    top2 = {sample(logits, [Sampling(temperature=2.0, top_k=2, seed=s)], [7])[0] for s in range(300)}
    assert top2 == {0, 1}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    picked = {sample(logits, [Sampling(temperature=1.0, top_p=0.7, seed=s)], [0])[0] for s in range(300)}
    assert picked == {0, 1}  # 0.5 < 0.7, so the 0.3 token is needed; 0.2 never


def test_a_temperature_too_small_to_divide_by_is_greedy() -> None:
    """Below `MIN_TEMPERATURE`, logits / temperature overflows to inf and the softmax to NaN:
    such a row is drawn greedily instead of from garbage."""
    logits = random_logits(3, 50, seed=5)
    for temperature in (5e-324, 1e-320, 1e-7):
        params = Sampling(temperature=temperature, seed=9)
        assert sample(logits, [params] * 3, [1, 2, 3]) == logits.argmax(dim=1).tolist()


def test_bad_sample_input_names_the_argument() -> None:
    logits = random_logits(2, 10, seed=4)
    with pytest.raises(ValueError, match="params and positions"):
        sample(logits, [GREEDY], [0, 1])
    with pytest.raises(ValueError, match="logits: expected a"):
        sample(logits[0], [GREEDY], [0])
    logits[1, 3] = float("nan")
    with pytest.raises(ValueError, match="row 1 holds NaN"):
        sample(logits, [GREEDY, GREEDY], [0, 1])
