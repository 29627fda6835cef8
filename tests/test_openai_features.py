"""OpenAI's `n`, `logprobs`, `echo`, lists of prompts, penalties and tools, read by the `openai`
package itself (its own types parse every shape) from the front door before the fake backend,
whose answer to a prompt is the prompt's own tokens and whose log-probability of each is -0.25.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx2
import trio
from serving_fakes import ByteCodec, FakeBackend, ToolCodec
from test_http_api import GUARD_S, MODEL, _leave_after, echo, live, poll

CODEC = ByteCodec()


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=GUARD_S)


def _session(url: str) -> dict[str, Any]:
    client = _client(url)
    msgs = [{"role": "user", "content": "abcdef"}]
    out: dict[str, Any] = {}
    out["chat_n"] = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, n=3, logprobs=True, top_logprobs=2
    )
    out["chat_n_stream"] = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=4,
            n=2,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    out["many"] = client.completions.create(
        model=MODEL, prompt=["hello", [120, 121, 122]], max_tokens=3, n=2, logprobs=2
    )
    out["many_stream"] = list(
        client.completions.create(model=MODEL, prompt=["hello", "world"], max_tokens=3, stream=True)
    )
    out["echo"] = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, echo=True)
    out["penalties"] = client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"104": -100},
        extra_body={"repetition_penalty": 1.2, "min_p": 0.1},
    )
    return out


async def test_the_openai_client_reads_n_choices_logprobs_echo_and_prompt_lists() -> None:
    async with live() as (url, backend):
        got = await trio.to_thread.run_sync(_session, url)
    prompt = CODEC.apply_chat_template([{"role": "user", "content": "abcdef"}])
    chat = got["chat_n"]
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.content == echo(prompt, 4) for c in chat.choices)
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == list(echo(prompt, 4))
    assert all(t.logprob == -0.25 and t.bytes == list(t.token.encode()) for t in content)
    assert [len(t.top_logprobs) for t in content] == [2] * 4 and content[0].top_logprobs[1].logprob == -2.0
    # OpenAI's usage: the prompt once, every choice's completion.
    assert chat.usage.prompt_tokens == len(CODEC.encode(prompt)) and chat.usage.completion_tokens == 12

    chunks = got["chat_n_stream"]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == echo(prompt, 4)
        tokens = [t.token for c in mine if c.logprobs for t in c.logprobs.content]
        assert "".join(tokens) == echo(prompt, 4)
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8

    many = got["many"]  # index = prompt * n + choice, as OpenAI assigns them
    assert [c.text for c in many.choices] == ["hel", "hel", "xyz", "xyz"]
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    lp = many.choices[2].logprobs
    assert lp.tokens == ["x", "y", "z"] and lp.token_logprobs == [-0.25] * 3 and lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs[0] == {"x": -0.25, "y": -2.0}
    assert many.usage.prompt_tokens == 5 + 3 and many.usage.completion_tokens == 12
    assert len({r.sampling.seed for r in backend.requests[-12:]} - {None}) == 0  # no seed asked: per rid

    texts: dict[int, str] = {}
    for c in got["many_stream"]:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "hel", 1: "wor"}

    assert got["echo"].choices[0].text == "hello" + "he"
    assert got["penalties"].choices[0].text == "he"  # the fake ignores them; the node applies them
    asked = backend.requests[-1].sampling
    assert (asked.presence_penalty, asked.frequency_penalty, asked.repetition_penalty) == (0.5, -0.5, 1.2)
    assert asked.logit_bias == ((104, -100.0),) and asked.min_p == 0.1


async def test_seeded_choices_draw_from_different_seeds() -> None:
    async with live() as (url, backend):
        await trio.to_thread.run_sync(
            lambda: _client(url).completions.create(model=MODEL, prompt="hi", max_tokens=1, n=3, seed=7)
        )
    seeds = [r.sampling.seed for r in backend.requests]
    assert 7 in seeds and len(set(seeds)) == 3  # the first choice has the seed asked for


def _tools_session(url: str) -> Any:
    client = _client(url)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "user", "content": "rain?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "wet"},
    ]
    return client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=300)


async def test_tools_and_tool_calls_are_rendered_by_a_template_that_has_them() -> None:
    async with live(codec=ToolCodec()) as (url, backend):
        reply = await trio.to_thread.run_sync(_tools_session, url)
    # The fake answers with the prompt itself: the rendered template, tool call and result in it.
    assert reply.choices[0].message.content.startswith(
        '<tools>weather;</tools>\n<user>rain?<assistant><call>weather({"city":"Oslo"})</call>'
        "<tool>wet[c1]<assistant>"  # trim_blocks, as Hugging Face renders, eats the newlines
    )


async def test_a_client_leaving_a_stream_of_several_choices_aborts_every_one() -> None:
    backend = FakeBackend(delay_s=0.02)
    async with live(backend) as (url, _):
        body = {"model": MODEL, "prompt": ["one", "two"], "n": 2, "max_tokens": 4000, "stream": True}
        await _leave_after(url, "/v1/completions", body, b'"text":"o')
        await poll(lambda: len(backend.aborted) == 4)
    assert sorted(backend.aborted) == sorted(r.rid for r in backend.requests) and not backend.active


async def test_a_client_leaving_before_several_whole_answers_aborts_every_one() -> None:
    backend = FakeBackend(delay_s=0.05)
    async with live(backend) as (url, _), httpx2.AsyncClient(base_url=url) as c:
        body = {"model": MODEL, "prompt": "slow", "n": 3, "max_tokens": 4000}
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(c.post, "/v1/completions", json=body))
                await poll(lambda: len(backend.active) == 3)
                scope.cancel()
        await poll(lambda: len(backend.aborted) == 3)
    assert not backend.active


async def test_a_choice_that_fails_fails_the_request_and_ends_the_others() -> None:
    backend = FakeBackend(delay_s=0.01, fail_after=3)
    async with live(backend) as (url, _), httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as c:
        whole = await c.post(
            "/v1/completions", json={"model": MODEL, "prompt": "abc", "n": 2, "max_tokens": 9}
        )
        assert whole.status_code == 503, whole.text
        streamed = await c.post(
            "/v1/completions", json={"model": MODEL, "prompt": "abc", "n": 2, "max_tokens": 9, "stream": True}
        )
    assert '"error"' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    assert not backend.active


def _continuous(url: str) -> list[Any]:
    client = _client(url)
    return list(
        client.completions.create(
            model=MODEL,
            prompt="hello",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )


async def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk() -> None:
    """vLLM's `stream_options.continuous_usage_stats`: each chunk's usage counts the tokens sent
    so far; the last chunk (no choices) the whole. Without `include_usage`, or an option no API
    defines, is a 400 naming it: never ignored."""
    async with live() as (url, _), httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as c:
        chunks = await trio.to_thread.run_sync(_continuous, url)
        prompt_tokens = len(CODEC.encode("hello"))
        with_text = [ch for ch in chunks if ch.choices]
        assert all(ch.usage is not None and ch.usage.prompt_tokens == prompt_tokens for ch in chunks)
        counts = [ch.usage.completion_tokens for ch in with_text]
        assert counts == sorted(counts) and counts[-1] == 4 and counts[0] >= 1, counts
        assert not chunks[-1].choices and chunks[-1].usage.total_tokens == prompt_tokens + 4
        for opts, param in [
            ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
            ({"include_usage": True, "usage_every": 2}, "stream_options.usage_every"),
        ]:
            body = {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": opts}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
