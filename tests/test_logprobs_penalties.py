"""Penalties, logit bias, min-p and log-probabilities: the batched sampler against plain
per-token references, and the whole path (front door, decode and prefill nodes, the exact
float64 tiny model) against a reference decode that applies them to the model's own logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sampling_limits import front_door

from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.model.sampling import adjust, choose, logprobs, sample
from hicache.runtime.wire.sampling_fields import Sampling

VOCAB = 40


def reference_adjust(row: torch.Tensor, p: Sampling, prompt: list[int], out: list[int]) -> torch.Tensor:
    """One row, one token at a time: repetition (prompt and output), then frequency and
    presence (output), then the bias, as documented in `adjust`."""
    x = row.clone()
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(out):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] = x[t] - p.frequency_penalty * out.count(t) - p.presence_penalty
    for t, bias in p.logit_bias:
        x[t] = x[t] + bias
    return x


_penalty = st.sampled_from([0.0, 0.5, -1.25, 2.0, -2.0]) | st.floats(-2, 2)
_sampling = st.builds(
    Sampling,
    presence_penalty=_penalty,
    frequency_penalty=_penalty,
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.7, 2.0]) | st.floats(0.01, 2),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
    logprobs=st.booleans(),
)
_tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@settings(max_examples=examples(150), deadline=None)
@given(
    rows=st.lists(st.tuples(_sampling, _tokens, _tokens), min_size=1, max_size=5),
    seed=st.integers(0, 2**31),
)
def test_batched_penalties_equal_the_per_token_reference(
    rows: list[tuple[Sampling, list[int], list[int]]], seed: int
) -> None:
    logits = torch.randn(
        (len(rows), VOCAB), generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    params = [p for p, _, _ in rows]
    before = logits.clone()
    got = adjust(logits, params, [q for _, q, _ in rows], [o for _, _, o in rows])
    assert torch.equal(logits, before)  # the model's logits are left as they were
    for b, (p, prompt, out) in enumerate(rows):
        want = reference_adjust(logits[b], p, prompt, out)
        assert torch.allclose(got[b], want, rtol=0, atol=1e-12), (p, prompt, out)


def test_a_bias_of_minus_100_bans_a_token_and_plus_100_forces_it() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.5, -2.0]], dtype=torch.float64)
    ban = Sampling(logit_bias={"0": -100})
    force = Sampling(logit_bias={3: 100})
    assert sample(adjust(logits, [ban], [[]], [[]]), [ban], [0]) == [1]
    assert sample(adjust(logits, [force], [[]], [[]]), [force], [0]) == [3]


def test_presence_and_frequency_penalties_follow_openais_definition() -> None:
    # OpenAI: mu[j] - alpha_frequency * c[j] - alpha_presence * (c[j] > 0), c over the output only.
    logits = torch.zeros((1, 5), dtype=torch.float64)
    p = Sampling(frequency_penalty=0.5, presence_penalty=1.0)
    got = adjust(logits, [p], [[4, 4, 4]], [[1, 1, 2]])[0].tolist()
    assert got == [0.0, -2.0, -1.5, 0.0, 0.0]  # the prompt's 4s are not counted


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**31), min_p=st.floats(0.01, 0.9), draw=st.integers(0, 2**40))
def test_min_p_never_draws_a_token_below_its_share_of_the_top(seed: int, min_p: float, draw: int) -> None:
    logits = torch.randn((1, 50), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    p = Sampling(temperature=1.0, min_p=min_p, seed=draw)
    probs = torch.softmax(logits[0], dim=0)
    for position in range(20):
        (token,) = sample(logits, [p], [position])
        assert probs[token] >= min_p * probs.max() - 1e-12


def test_logprobs_are_the_raw_log_softmax_and_the_top_ones_best_first() -> None:
    logits = torch.randn((3, 30), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the lower id first
    params = [
        Sampling(logprobs=True, top_logprobs=4, temperature=5.0, logit_bias={2: 50}),
        Sampling(logprobs=True, top_logprobs=2),
        Sampling(),
    ]
    tokens, got = choose(logits, params, [1, 2, 3], [[], [], []], [[], [], []], request_keys=["a", "b", "c"])
    assert tokens[0] == 2  # drawn from the biased logits ...
    lp = torch.log_softmax(logits, dim=1)
    assert got[0] is not None and got[0][0] == pytest.approx(
        float(lp[0, 2]), abs=1e-12
    )  # ... not reported so
    assert [t for t, _ in got[0][1]] == torch.argsort(-lp[0], stable=True)[:4].tolist()
    assert got[1] is not None and [t for t, _ in got[1][1]] == [7, 9]
    assert got[2] is None
    assert logprobs(logits, params, tokens) == got


# ------------------------------------------------------------------ the whole path, exact


def reference_decode(prompt: list[int], n: int, p: Sampling) -> tuple[list[int], list[Any]]:
    """Greedy decoding of the tiny model's monolithic forward with the per-token reference
    adjustment; each token's log-probabilities from the raw logits."""
    model = TinyModel(TinyConfig())
    out: list[int] = []
    lps: list[Any] = []
    for _ in range(n):
        _, logits = model.forward(torch.tensor(prompt + out, dtype=torch.int64))
        token = int(torch.argmax(reference_adjust(logits, p, prompt, out)))
        lp = torch.log_softmax(logits.to(torch.float64), dim=0)
        top = torch.argsort(-lp, stable=True)[: p.top_logprobs].tolist()
        lps.append((float(lp[token]), [(t, float(lp[t])) for t in top]))
        out.append(token)
    return out, lps


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 1.8, "frequency_penalty": 0.7, "presence_penalty": 0.4},
        {"logit_bias": {"17": 4.5, "300": -100}, "frequency_penalty": -0.3},
        {},
    ],
)
async def test_the_nodes_report_the_models_logprobs_and_apply_penalties_exactly(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    prompt = [(7 * i + 3) % 500 for i in range(40)]
    n, top = 6, 3
    spec = Sampling(temperature=0.0, logprobs=True, top_logprobs=top, **fields)
    want, want_lps = reference_decode(prompt, n, spec)
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **fields},
        "return_logprob": True,
        "top_logprobs_num": top,
    }
    async with front_door(tmp_path) as c:
        got = (await c.post("/generate", json=body)).json()
        streamed = await c.post("/generate", json={**body, "stream": True})
    assert got["output_ids"] == want
    meta = got["meta_info"]
    # SGLang's default start: the prompt's last token, whose entry is always None.
    assert meta["input_token_logprobs"] == [[None, prompt[-1], None]] and meta["input_top_logprobs"] == [None]
    for (lp, _, text), top_got, (want_lp, want_top) in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], want_lps, strict=True
    ):
        assert text is None and math.isclose(lp, want_lp, abs_tol=1e-9)
        assert [t for _, t, _ in top_got] == [t for t, _ in want_top]
        assert all(
            math.isclose(a, b, abs_tol=1e-9) for (a, _, _), (_, b) in zip(top_got, want_top, strict=True)
        )
    assert [token for _, token, _ in meta["output_token_logprobs"]] == want
    lines = [line for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
