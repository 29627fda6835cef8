"""The prompt's own log-probabilities (SGLang's `logprob_start_len`, OpenAI's `echo` with
`logprobs`): through the real front door, decode and prefill nodes on the exact float64 tiny
model, chunked and after the prompt is cached on both nodes, against the model's monolithic
forward over each prefix; and read by the `openai` package itself."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from serving_fakes import ByteCodec
from test_sampling_limits import front_door

from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.model.sampling import prompt_logprobs
from hicache.runtime.wire.sampling_fields import Sampling, SamplingError

PROMPT = [(11 * i + 5) % 90 + 33 for i in range(70)]  # printable ASCII: one character each
CHUNK = 16  # prefill computes the prompt in 5 chunks


def reference(prompt: list[int], start: int, top: int) -> list[Any]:
    """From `start` on: None, then each token's log-probability given the tokens before it and
    the `top` most likely tokens there (ties: the lower id), from the whole prefix's forward."""
    model = TinyModel(TinyConfig())
    out: list[Any] = [None]
    for j in range(start + 1, len(prompt)):
        _, logits = model.forward(torch.tensor(prompt[:j], dtype=torch.int64))
        lp = torch.log_softmax(logits.to(torch.float64), dim=0)
        best = torch.argsort(-lp, stable=True)[:top].tolist()
        out.append((float(lp[prompt[j]]), [(t, float(lp[t])) for t in best]))
    return out


def close(a: float | None, b: float | None) -> bool:
    return a is None and b is None or (a is not None and b is not None and math.isclose(a, b, abs_tol=1e-9))


def check_sglang(meta: dict[str, Any], prompt: list[int], start: int, top: int) -> None:
    want = reference(prompt, start, top)
    got, got_top = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [token for _, token, _ in got] == prompt[start:]
    assert got[0] == [None, prompt[start], None] and got_top[0] is None  # SGLang's: always None
    for (lp, _, text), tops, w in zip(got[1:], got_top[1:], want[1:], strict=True):
        assert text is None and close(lp, w[0])
        assert [t for _, t, _ in tops] == [t for t, _ in w[1]]
        assert all(close(v, wv) for (v, _, _), (_, wv) in zip(tops, w[1], strict=True))


def test_the_sampling_asks_for_prompt_logprobs_only_with_logprobs() -> None:
    assert Sampling(logprobs=True, prompt_logprobs_from=0).prompt_logprobs_from == 0
    for bad in (
        {"prompt_logprobs_from": 3},  # without logprobs
        {"logprobs": True, "prompt_logprobs_from": -2},
        {"logprobs": True, "prompt_logprobs_from": 2**31},
        {"logprobs": True, "prompt_logprobs_from": 1.5},
    ):
        with pytest.raises(SamplingError, match="prompt_logprobs_from"):
            Sampling(**bad)


def test_a_forward_gives_every_asked_rows_logits_as_each_prefix_alone_would() -> None:
    model = TinyModel(TinyConfig())
    ids = torch.tensor(PROMPT[:20], dtype=torch.int64)
    kv, rows = model.forward(ids[12:], model.forward(ids[:12])[0], rows_from=3)  # positions 15..19
    whole_kv, last = model.forward(ids)
    assert rows.shape == (5, model.config.vocab)
    assert torch.allclose(rows[-1], last, rtol=0, atol=1e-12)
    assert torch.allclose(kv, whole_kv[:, :, 12:], rtol=0, atol=1e-12)
    for i in range(5):
        _, alone = model.forward(ids[: 16 + i])
        assert torch.allclose(rows[i], alone, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="rows_from"):
        model.forward(ids[:4], rows_from=4)
    spec = Sampling(logprobs=True, top_logprobs=2)
    got = prompt_logprobs(rows[:4], PROMPT[16:20], spec)
    lp = torch.log_softmax(rows[:4].to(torch.float64), dim=1)
    assert [g[0] for g in got] == pytest.approx([float(lp[i, PROMPT[16 + i]]) for i in range(4)], abs=1e-12)


async def test_sglang_input_token_logprobs_are_the_models_own_chunked_and_after_a_cache_hit(
    tmp_path: Path,
) -> None:
    n, top = 4, 3
    plain = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    asked = {**plain, "return_logprob": True, "top_logprobs_num": top}
    async with front_door(tmp_path, prefill={"chunk_tokens": CHUNK}) as c:
        first = (await c.post("/generate", json=plain)).json()  # now cached on both nodes
        scored = (await c.post("/generate", json={**asked, "logprob_start_len": 5})).json()
        streamed = await c.post("/generate", json={**asked, "logprob_start_len": 0, "stream": True})
        default = (await c.post("/generate", json=asked)).json()
        past = (await c.post("/generate", json={**asked, "logprob_start_len": len(PROMPT)})).json()
    assert scored["output_ids"] == first["output_ids"]
    assert scored["meta_info"]["cached_tokens"] > 0  # the decode node's cache still served it
    check_sglang(scored["meta_info"], PROMPT, 5, top)
    lines = [
        json.loads(x.removeprefix("data: ")) for x in streamed.text.split("\n\n") if x.startswith("data: {")
    ]
    check_sglang(lines[-1]["meta_info"], PROMPT, 0, top)
    # SGLang's default start is the prompt's last token, whose entry is None: nothing to compute.
    assert default["meta_info"]["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    assert default["meta_info"]["input_top_logprobs"] == [None]
    assert past["meta_info"]["input_token_logprobs"] == [] and past["output_ids"] == first["output_ids"]


def _echo(url: str, prompt: list[int]) -> tuple[Any, list[Any]]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    whole = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0, stream=True
        )
    )
    return whole, chunks


async def test_openai_echo_with_logprobs_scores_the_prompt_then_the_output(tmp_path: Path) -> None:
    prompt = PROMPT[:40]
    want = reference(prompt, 0, 2)
    async with front_door(tmp_path, prefill={"chunk_tokens": CHUNK}) as c:
        whole, chunks = await trio.to_thread.run_sync(_echo, str(c.base_url).rstrip("/"), prompt)
    choice = whole.choices[0]
    lp = choice.logprobs
    text = bytes(prompt).decode("ascii")
    assert choice.text.startswith(text) and lp.tokens[: len(prompt)] == list(text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # vLLM's first entry
    for got, tops, w in zip(lp.token_logprobs[1:40], lp.top_logprobs[1:40], want[1:], strict=True):
        # The legacy shape keys the top tokens by text: ids the codec shows alike share a key.
        by_text = {ByteCodec().decode([t]): v for t, v in reversed(w[1])}  # the likelier wins
        assert close(got, w[0]) and tops.keys() == by_text.keys()
        assert all(close(tops[k], v) for k, v in by_text.items())
    assert len(lp.tokens) == 40 + 3 and all(v is not None for v in lp.token_logprobs[40:])
    assert lp.text_offset[:3] == [0, 1, 2] and lp.text_offset[40] == len(text)
    # Streamed: the echo's chunk carries the prompt's, the later ones the output's.
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for ch in chunk.choices:
            if ch.logprobs is not None:
                for key in streamed:
                    streamed[key] += getattr(ch.logprobs, key)
    assert streamed == {key: getattr(lp, key) for key in streamed}
    assert "".join(ch.text for chunk in chunks for ch in chunk.choices) == choice.text


async def test_prompt_logprobs_too_large_for_one_answer_are_a_400_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache.runtime.prefill import prefill_node

    monkeypatch.setattr(prefill_node, "MAX_SCORES_JSON", 200)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    async with front_door(tmp_path) as c:
        refused = await c.post("/generate", json={**body, "logprob_start_len": 0, "top_logprobs_num": 5})
        fits = await c.post("/generate", json={**body, "logprob_start_len": len(PROMPT) - 3})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "request_refused" and "logprob_start_len" in error["message"], error
    assert fits.status_code == 200 and len(fits.json()["meta_info"]["input_token_logprobs"]) == 3
