"""The decode node's HTTP front door (runtime/serving/) on a real loopback port, driven by real
clients: the `openai` package, SGLang's streaming wire format read the way bench_multiturn.py
reads it, raw HTTP for refusals, hypothesis for hostile bodies, and Prometheus' own parser.

The backend is tests/serving_fakes.py's FakeBackend: it answers a prompt with the prompt's own
tokens, so every expected output below is a slice of the prompt.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from serving_fakes import EOS, ByteCodec, FakeBackend

from hicache.runtime.security.api_keys import ApiKeys
from hicache.runtime.serving import create_app, serve_http
from hicache.runtime.serving.detokenize import IncrementalDetokenizer
from hicache.runtime.serving.stops import StopStrings

MODEL = "fake-echo"
GUARD_S = 20  # a guard against hangs, never a speed assertion (as in node_pair.py)
CODEC = ByteCodec()


@contextlib.asynccontextmanager
async def live(
    backend: FakeBackend | None = None, codec: ByteCodec = CODEC, **kwargs: Any
) -> AsyncIterator[tuple[str, FakeBackend]]:
    """The app on 127.0.0.1, port 0, served by Hypercorn's trio worker in this trio run."""
    backend = FakeBackend() if backend is None else backend
    app = create_app(backend, codec, model_name=MODEL, **kwargs)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, app, "127.0.0.1", 0)
        yield f"http://127.0.0.1:{port}", backend
        nursery.cancel_scope.cancel()


def echo(prompt: str, n: int) -> str:
    """What the fake answers to `prompt` in `n` tokens (whole characters only)."""
    ids = CODEC.encode(prompt)
    return CODEC.decode([ids[i % len(ids)] for i in range(n)])


def chat_prompt(content: str) -> str:
    return CODEC.apply_chat_template([{"role": "user", "content": content}])


async def poll(condition: Any) -> None:
    """Wait until `condition()` holds; the guard only stops a hang, it times nothing."""
    with trio.fail_after(GUARD_S):
        while not condition():
            await trio.sleep(0.01)


# ============================================================================ OpenAI's API


def _openai_session(url: str) -> dict[str, Any]:
    import openai  # here, not at the top: importing it takes about a second of collection

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=GUARD_S)
    out: dict[str, Any] = {
        "models": [m.id for m in client.models.list()],
        "model": client.models.retrieve(MODEL),
    }
    msgs = [{"role": "user", "content": "Bonjour, ça va?"}]
    out["chat"] = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
    out["chat_again"] = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    out["chat_chunks"] = chunks
    out["completion"] = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=9)
    out["completion_chunks"] = list(
        client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=9, stream=True)
    )
    out["stopped"] = client.completions.create(model=MODEL, prompt="abcabcabc", max_tokens=9, stop=["ca"])
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=msgs)
    out["missing"] = missing.value
    with pytest.raises(openai.BadRequestError) as two:
        client.completions.create(model=MODEL, prompt="x", n=17)
    out["n2"] = two.value
    return out


async def test_the_openai_client_gets_chat_and_completions_streaming_or_not() -> None:
    async with live() as (url, backend):
        got = await trio.to_thread.run_sync(_openai_session, url)
    assert got["models"] == [MODEL] and got["model"].id == MODEL and got["model"].object == "model"
    prompt = chat_prompt("Bonjour, ça va?")
    chat = got["chat"]
    assert chat.object == "chat.completion" and chat.model == MODEL
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == echo(prompt, 12)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == len(CODEC.encode(prompt))
    assert chat.usage.completion_tokens == 12 and chat.usage.total_tokens == chat.usage.prompt_tokens + 12
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    # The same prompt again: the fake's L1 holds all of it, and usage says so.
    assert got["chat_again"].usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens

    chunks = got["chat_chunks"]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echo(prompt, 12)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])

    completion = got["completion"]
    assert completion.object == "text_completion"
    assert completion.choices[0].text == echo("the quick brown fox", 9) == "the quick"
    streamed = got["completion_chunks"]
    assert "".join(c.choices[0].text for c in streamed) == "the quick"
    assert streamed[-1].choices[0].finish_reason == "length"

    # A stop string cuts the text before it and aborts the backend's request.
    stopped = got["stopped"]
    assert stopped.choices[0].text == "ab" and stopped.choices[0].finish_reason == "stop"
    assert backend.requests[-1].rid in backend.aborted

    missing = got["missing"]
    assert missing.status_code == 404
    assert set(missing.body) == {"message", "type", "param", "code"}
    assert missing.body["code"] == "model_not_found" and "no-such-model" in missing.body["message"]
    assert got["n2"].status_code == 400 and got["n2"].body["param"] == "n"


async def test_a_refused_request_is_a_503_streaming_or_not() -> None:
    async with (
        live(FakeBackend(refuse="the queue is full")) as (url, _),
        httpx2.AsyncClient(base_url=url) as c,
    ):
        for path, body in [
            ("/generate", {"text": "hi"}),
            ("/generate", {"text": "hi", "stream": True}),
            ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
            ),
        ]:
            r = await c.post(path, json=body)
            assert r.status_code == 503, (path, body, r.text)
            assert r.json()["error"]["message"] == "the queue is full"


async def test_a_request_the_node_refuses_as_it_is_is_a_400_naming_why() -> None:
    """A prompt over a limit of the node's (prefill's `--staging-pages`) fails again if sent
    again: the client's to change, so a 400 with the node's sentence, not a 503 to retry."""
    why = "the prompt needs 19 staging pages to send, more than this prefill node's 8 (--staging-pages)"
    async with (
        live(FakeBackend(refuse=why, refuse_as_is=True)) as (url, _),
        httpx2.AsyncClient(base_url=url) as c,
    ):
        for path, body in [
            ("/generate", {"text": "hi"}),
            ("/generate", {"text": "hi", "stream": True}),
            ("/generate", {"text": ["hi", "yo"]}),
            ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True}),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
            ),
        ]:
            r = await c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            error = r.json()["error"]
            assert error["message"] == why and error["code"] == "request_refused", (path, error)
            assert "Retry-After" not in r.headers


def _openai_stream_breaks(url: str) -> str:
    import openai  # here, not at the top: importing it takes about a second of collection

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=GUARD_S)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, stream=True
    )
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    return err.value.message


async def test_a_backend_that_fails_mid_answer_ends_it_with_an_error_not_a_500() -> None:
    async with live(FakeBackend(fail_after=3)) as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        r = await c.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 9}})
        assert r.status_code == 503 and "the fake broke" in r.json()["error"]["message"]
        lines = await _read_like_bench_multiturn(c, {"text": "hello", "stream": True})
        assert lines[-2]["text"] == "hel"
        assert lines[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert "the fake broke" in lines[-1]["meta_info"]["finish_reason"]["message"]
        assert "the fake broke" in await trio.to_thread.run_sync(_openai_stream_breaks, url)
        assert (await c.get("/health")).status_code == 200 and not backend.active
        s = _samples((await c.get("/metrics")).text)
    assert s[("hicache_requests_total", (("api", "generate"), ("outcome", "error")))] == 2
    assert s[("hicache_requests_total", (("api", "chat"), ("outcome", "error")))] == 1


async def test_serve_http_stops_on_its_shutdown_trigger() -> None:
    stop = trio.Event()
    app = create_app(FakeBackend(), CODEC, model_name=MODEL)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                functools.partial(serve_http, app, "127.0.0.1", 0, shutdown_trigger=stop.wait)
            )
            async with httpx2.AsyncClient() as c:
                assert (await c.get(f"http://127.0.0.1:{port}/health")).status_code == 200
            stop.set()  # the nursery ends only if serve_http returns


# ============================================================================ SGLang's API


async def _read_like_bench_multiturn(c: httpx2.AsyncClient, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """bench_multiturn.py's reader: strip each line, skip blanks, drop 'data: ', stop at [DONE]."""
    lines: list[dict[str, Any]] = []
    done = False
    async with c.stream("POST", "/generate", json=payload) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for raw in r.aiter_lines():
            chunk = raw.strip()
            if not chunk:
                continue
            chunk = chunk.removeprefix("data: ")
            if chunk == "[DONE]":
                done = True
                continue
            assert not done, "nothing may follow [DONE]"
            lines.append(json.loads(chunk))
    assert done
    return lines


async def test_sglang_streaming_generate_sends_cumulative_text_then_done() -> None:
    prompt = "héllo wörld, 日本"  # multi-byte characters: tokens end inside them
    payload = {
        "text": prompt,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": len(CODEC.encode(prompt)),
            "ignore_eos": True,
        },
        "stream": True,
        "lora_path": "",
        "return_logprob": False,
        "logprob_start_len": -1,
    }
    async with live() as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        lines = await _read_like_bench_multiturn(c, payload)
        again = await _read_like_bench_multiturn(c, payload)
    texts = [line["text"] for line in lines]
    assert texts[-1] == prompt
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before)  # cumulative, never taken back
    assert not any("\ufffd" in t for t in texts)  # half a character is never shown
    ids = [line["output_ids"] for line in lines]
    assert ids[-1] == CODEC.encode(prompt) and all(
        b == a[: len(b)] for a, b in zip(ids[1:], ids, strict=False)
    )
    assert [line["meta_info"]["finish_reason"] for line in lines[:-1]] == [None] * (len(lines) - 1)
    last = lines[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": len(CODEC.encode(prompt))}
    assert last["prompt_tokens"] == len(CODEC.encode(prompt)) == last["completion_tokens"]
    assert last["cached_tokens"] == 0 and again[-1]["meta_info"]["cached_tokens"] == last["prompt_tokens"]
    hit = last["prompt_tokens"]
    assert again[-1]["meta_info"]["cached_tokens_details"] == {
        "device": hit,
        "host": 0,
        "storage": 0,
        "l1": hit,
        "l2": 0,
        "l3": 0,
    }
    assert backend.requests[0].sampling.ignore_eos and backend.requests[0].sampling.temperature == 0.0


async def test_sglang_generate_answers_text_or_ids_with_finish_reasons() -> None:
    async with live(FakeBackend(eos_after=4)) as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        r = await c.post("/generate", json={"text": "abcdefgh", "sampling_params": {"max_new_tokens": 20}})
        assert r.status_code == 200
        out = r.json()
        assert out["text"] == "abcd" and out["output_ids"] == [*b"abcd", EOS]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
        assert set(out["meta_info"]) >= {
            "id",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "e2e_latency",
        }
        # SGLang's names (python/sglang/srt/managers/scheduler_output_processor_mixin.py) and ours
        assert set(out["meta_info"]["cached_tokens_details"]) == {
            "device",
            "host",
            "storage",
            "l1",
            "l2",
            "l3",
        }

        r = await c.post(
            "/generate",
            json={
                "input_ids": [*b"xyz"],
                "rid": "mine",
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            },
        )
        out = r.json()
        assert out["text"] == "xyzxy" and out["meta_info"]["id"] == "mine"
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
        assert backend.requests[-1].rid != "mine"  # the backend's ids stay the front door's

        stop_two = {"text": "one two one", "sampling_params": {"stop": "two", "ignore_eos": True}}
        out = (await c.post("/generate", json=stop_two)).json()
        assert out["text"] == "one " and out["meta_info"]["finish_reason"] == {
            "type": "stop",
            "matched": "two",
        }
        assert backend.aborted == [backend.requests[-1].rid]  # the stop string ended it early
        out = (await c.post("/generate", json=stop_two)).json()  # the account rode on the first token
        assert out["meta_info"]["cached_tokens_details"]["l1"] == len("one two one")

        sid = ord("c")
        r = await c.post("/generate", json={"text": "abcd", "sampling_params": {"stop_token_ids": [sid]}})
        assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": sid}
        assert backend.requests[-1].sampling.stop_token_ids == (sid,)


async def test_flush_cache_health_and_model_info() -> None:
    async with live() as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        body = {"text": "some prompt", "sampling_params": {"max_new_tokens": 2}}
        await c.post("/generate", json=body)
        assert (await c.post("/generate", json=body)).json()["meta_info"]["cached_tokens"] == 11
        r = await c.post("/flush_cache")
        assert r.status_code == 200 and r.text and backend.flushes == 1
        assert (await c.post("/generate", json=body)).json()["meta_info"]["cached_tokens"] == 0

        r = await c.get("/health")
        assert r.status_code == 200 and r.content == b""
        assert (await c.get("/health_generate")).status_code == 200
        info = (await c.get("/get_model_info")).json()
        assert (
            info["model_path"] == "fake/byte-echo"
            and info["is_generation"] is True
            and "tokenizer_path" in info
        )
        server = (await c.get("/get_server_info")).json()
        assert server["context_length"] == backend.max_context and server["served_model_name"] == MODEL


# ============================================================================ clients that leave


async def test_a_streamed_batch_interleaves_each_prompts_lines_by_index_then_one_done() -> None:
    """SGLang's streamed batch: every line is one prompt's cumulative snapshot with its `index`;
    each prompt's last line carries its finish_reason; one [DONE] after them all."""
    payload = {
        "text": ["abcdef", "xyz"],
        "sampling_params": [{"max_new_tokens": 6}, {"max_new_tokens": 2}],
        "rid": ["first", "second"],
        "stream": True,
    }
    async with live() as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        lines = await _read_like_bench_multiturn(c, payload)
    by_index = {i: [line for line in lines if line["index"] == i] for i in (0, 1)}
    assert len(lines) == len(by_index[0]) + len(by_index[1])
    for i, (text, n, rid) in enumerate([("abcdef", 6, "first"), ("xy", 2, "second")]):
        mine = by_index[i]
        texts = [line["text"] for line in mine]
        assert texts[-1] == text and all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
        reasons = [line["meta_info"]["finish_reason"] for line in mine]
        assert reasons[:-1] == [None] * (len(mine) - 1) and reasons[-1] == {"type": "length", "length": n}
        assert {line["meta_info"]["id"] for line in mine} == {rid}
    assert len(backend.requests) == 2 and not backend.active


async def _leave_after(url: str, path: str, body: dict[str, Any], marker: bytes) -> None:
    """POST `body`, read the stream until `marker` shows, and hang up (no client library, so
    the connection closes at once, not when a pool gets round to it)."""
    port = int(url.rsplit(":", 1)[1])
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(head.encode() + data)
        seen = b""
        while marker not in seen:
            chunk = await stream.receive_some()
            assert chunk, seen
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200")


async def test_a_client_leaving_mid_stream_aborts_its_request() -> None:
    backend = FakeBackend(delay_s=0.02)
    async with live(backend) as (url, _), httpx2.AsyncClient(base_url=url) as c:
        body = {"text": "a long answer", "sampling_params": {"max_new_tokens": 4000}, "stream": True}
        await _leave_after(url, "/generate", body, b"data: {")  # after the first token
        await poll(lambda: backend.aborted)
        assert backend.aborted == [backend.requests[0].rid] and not backend.active

        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        await _leave_after(url, "/v1/chat/completions", chat, b'"content":"<')
        await poll(lambda: len(backend.aborted) == 2)
        batch = {
            "text": ["one long", "two long"],
            "sampling_params": {"max_new_tokens": 4000},
            "stream": True,
        }
        await _leave_after(url, "/generate", batch, b'"index":')  # every prompt of it ends
        await poll(lambda: len(backend.aborted) == 4)
        assert sorted(backend.aborted[2:]) == sorted(r.rid for r in backend.requests[2:])
        assert not backend.active
        metrics = (await c.get("/metrics")).text
    assert 'hicache_requests_total{api="generate",outcome="disconnect"} 3.0' in metrics
    assert 'hicache_requests_total{api="chat",outcome="disconnect"} 1.0' in metrics


async def test_a_client_leaving_before_a_whole_answer_aborts_its_request() -> None:
    backend = FakeBackend(delay_s=0.05)
    async with live(backend) as (url, _), httpx2.AsyncClient(base_url=url) as c:
        for body in (
            {"text": "slow", "sampling_params": {"max_new_tokens": 4000}},  # waiting for the whole answer
            {"text": "slow", "sampling_params": {"max_new_tokens": 4000}, "stream": True},  # the first token
        ):
            aborted = len(backend.aborted)
            backend.delay_s = 0.05 if "stream" not in body else 3600.0
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(functools.partial(c.post, "/generate", json=body))
                    await poll(lambda: backend.active)
                    scope.cancel()
            await poll(lambda a=aborted: len(backend.aborted) == a + 1)
            assert not backend.active


# ============================================================================ refusals


BAD: list[tuple[str, bytes | dict[str, Any], int, str]] = [
    ("/generate", b"{not json", 400, "not JSON"),
    ("/generate", b"[1, 2]", 400, "JSON object"),
    ("/generate", b'{"text": "hi", "sampling_params": {"temperature": NaN}}', 400, "not JSON"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "exactly one"),
    ("/generate", {}, 400, "exactly one"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "1 items for 2 prompts"),
    ("/generate", {"text": ["a", 5]}, 400, "'text[1]' must be a string"),
    ("/generate", {"text": []}, 400, "the batch is empty"),
    ("/generate", {"input_ids": [[1], [1, 999]]}, 400, "'input_ids[1]'"),
    ("/generate", {"text": "hi", "sampling_params": {"temprature": 0}}, 400, "'sampling_params.temprature'"),
    ("/generate", {"text": "hi", "max_new_tokens": 4}, 400, "'max_new_tokens' is not a field"),
    ("/generate", {"text": "hi", "sampling_params": {"no_stop_trim": 1}}, 400, "true or false"),
    ("/generate", {"text": "hi", "sampling_params": {"skip_special_tokens": False}}, 400, "not supported"),
    ("/generate", {"text": "hi", "data_parallel_rank": 1}, 400, "'data_parallel_rank' = 1 is not supported"),
    ("/generate", {"text": "hi", "priority": 1}, 400, "'priority' = 1 is not supported"),
    ("/v1/completions", {"prompt": "hi", "max_new_tokens": 4}, 400, "'max_new_tokens' is not a field"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "prompt": "x"},
        400,
        "'prompt'",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "store": True}, 400, "'store'"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": True}},
        400,
        "'chat_template_kwargs'",
    ),
    ("/generate", {"text": ""}, 400, "must not be empty"),
    ("/generate", {"text": 5}, 400, "must be a string"),
    ("/generate", {"input_ids": [1, 999]}, 400, "token ids in [0, 260)"),
    ("/generate", {"input_ids": [True]}, 400, "token ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400, "between 1 and"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**30}}, 400, "between 1 and"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4095}}, 400, "at most 4096 tokens"),
    ("/generate", {"text": "x" * 5000}, 400, "no room to generate"),
    ("/generate", {"text": "x" * 40_000}, 400, "no room to generate"),  # tokenized in a thread
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40_000}]}, 400, "no room"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, 400, "must be a number"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, 400, "'sampling_params.top_p'"),
    ("/generate", {"text": "hi", "sampling_params": {"ignore_eos": 1}}, 400, "true or false"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [""]}}, 400, "must not be empty"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2}}, 400, "not supported"),
    ("/generate", {"text": "hi", "sampling_params": []}, 400, "must be an object"),
    ("/generate", {"text": "hi", "stream": "yes"}, 400, "'stream'"),
    ("/generate", {"text": "\ud800"}, 400, "lone surrogate"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -2}, 400, "logprob_start_len"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, 400, "top_logprobs_num"),
    ("/v1/completions", {"model": "other", "prompt": "hi"}, 404, "does not exist"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", 3]}, 400, "'prompt[1]'"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 129}, 400, "more than 128"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 9, "n": 16}, 400, "over 128 choices"),
    ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "'prompt'"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "'max_tokens'"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "'logprobs'"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 1, "echo": "yes"}, 400, "'echo'"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_logprobs": 2}, 400, "'top_logprobs' is not"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"999": 1}}, 400, "'logit_bias'"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 3}, 400, "'presence_penalty'"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "min_p": 1}, 400, "'min_p'"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "non-empty list"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
        400,
        "template",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "type 'text'",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 17},
        400,
        "'n'",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "needs 'logprobs'",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "'tools' cannot be rendered",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            ],
        },
        400,
        "'messages[1].tool_calls' cannot be rendered",
    ),
    ("/v1/nothing", {}, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "says"), BAD, ids=[f"{p}:{s}" for p, _, _, s in BAD])
async def test_a_bad_request_gets_a_4xx_that_says_why(
    path: str, body: bytes | dict[str, Any], status: int, says: str
) -> None:
    async with live() as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        if isinstance(body, bytes):
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await c.post(path, content=json.dumps(body))  # json.dumps keeps a lone surrogate escaped
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and says in error["message"], error
        assert not backend.requests


async def test_a_body_over_the_limit_is_refused() -> None:
    async with live(max_body_bytes=1000) as (url, _), httpx2.AsyncClient(base_url=url) as c:
        r = await c.post("/generate", json={"text": "x" * 2000})
        assert r.status_code == 413 and "error" in r.json()

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            yield b'{"text": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'

        r = await c.post("/generate", content=chunked())
        assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]
        assert (await c.post("/generate", json={"text": "ok"})).status_code == 200


# ---------------------------------------------------------------------------- hostile bodies

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_num = st.integers(min_value=-5, max_value=400) | st.floats() | _json
_SAMPLING = (
    "max_new_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
)
_sampling = {k: _num for k in _SAMPLING} | {
    "ignore_eos": st.booleans() | _json,
    "n": st.sampled_from([1, 2]) | _json,
}
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json,
        "content": _json,
    },
)
_bodies = st.one_of(
    st.tuples(
        st.just("/generate"),
        st.fixed_dictionaries(
            {},
            optional={
                "text": st.text(max_size=40) | _json,
                "input_ids": st.lists(st.integers(-3, 300), max_size=40) | _json,
                "sampling_params": st.fixed_dictionaries({}, optional=_sampling) | _json,
                "stream": st.booleans() | _json,
                "rid": st.text(max_size=10) | _json,
            },
        ),
    ),
    st.tuples(
        st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        st.fixed_dictionaries(
            {},
            optional={
                "model": st.just(MODEL) | _json,
                "prompt": st.text(max_size=40) | st.lists(st.integers(-3, 300), max_size=20) | _json,
                "messages": st.lists(_message, max_size=3) | _json,
                "stream": st.booleans() | _json,
                "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _json})
                | _json,
                **_sampling,
            },
        ),
    ),
    st.tuples(st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"]), _json),
)


def _fuzz(url: str) -> int:
    sent = 0
    with httpx2.Client(base_url=url, timeout=GUARD_S) as client:

        @settings(deadline=None)
        @given(case=_bodies, raw=st.booleans(), junk=st.binary(max_size=30))
        def one(case: tuple[str, Any], raw: bool, junk: bytes) -> None:
            nonlocal sent
            path, body = case
            data = junk if raw else json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
            r = client.post(path, content=data, headers={"content-type": "application/json"})
            sent += 1
            assert r.status_code < 500 or r.status_code == 503, (path, body, r.status_code, r.text)
            if r.status_code >= 400:
                assert r.json()["error"]["message"]

        one()
    return sent


async def test_hostile_bodies_never_get_a_5xx_and_the_server_keeps_serving() -> None:
    # A small context keeps each accepted request short (the fake answers up to its end).
    async with live(FakeBackend(max_context=96)) as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        sent = await trio.to_thread.run_sync(_fuzz, url)
        assert sent >= 20
        assert (await c.get("/health")).status_code == 200
        r = await c.post("/generate", json={"text": "still here", "sampling_params": {"max_new_tokens": 5}})
        assert r.json()["text"] == "still"
        await poll(lambda: not backend.active)  # nothing left running for a client that left


# ============================================================================ metrics and keys


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_count_requests_tokens_tiers_and_backend_gauges() -> None:
    async with live() as (url, _), httpx2.AsyncClient(base_url=url) as c:
        body = {"text": "twelve chars", "sampling_params": {"max_new_tokens": 3}}
        for _ in range(3):
            assert (await c.post("/generate", json=body)).status_code == 200
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "stream": True,
        }
        assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
        assert (await c.post("/generate", json={"text": ""})).status_code == 400
        r = await c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = _samples(r.text)
    m = (("model_name", MODEL),)
    assert s[("hicache_requests_total", (("api", "generate"), ("outcome", "length")))] == 3
    assert s[("hicache_requests_total", (("api", "chat"), ("outcome", "length")))] == 1
    assert s[("hicache_requests_total", (("api", "generate"), ("outcome", "rejected")))] == 1
    assert s[("sglang:num_requests_total", m)] == 4  # SGLang counts those that reached the model
    assert s[("sglang:num_aborted_requests_total", m)] == 0
    assert s[("sglang:time_to_first_token_seconds_count", m)] == 4
    assert s[("sglang:e2e_request_latency_seconds_count", m)] == 4
    assert s[("sglang:inter_token_latency_seconds_count", m)] == 3 * 2 + 1
    prompt = 3 * 12 + len(CODEC.encode(chat_prompt("x")))
    assert s[("sglang:prompt_tokens_total", m)] == prompt
    assert s[("sglang:generation_tokens_total", m)] == 3 * 3 + 2
    assert s[("sglang:cached_tokens_total", (("cache_source", "device"), *m))] == 2 * 12
    assert s[("sglang:cached_tokens_total", (("cache_source", "storage"), *m))] == 0
    assert s[("sglang:cache_hit_rate", m)] == pytest.approx(2 * 12 / prompt)
    assert s[("hicache_cached_tokens_total", (("tier", "l1"),))] == 2 * 12
    assert s[("hicache_cached_tokens_total", (("tier", "l3"),))] == 0
    assert s[("hicache_backend_pool_l1_used_pages", ())] == 3.0
    assert s[("hicache_backend_requests_active", ())] == 0.0


ACME = "sk-acme-0123456789abcdef"
ROOT = "sk-root-0123456789abcdef"
KEYS = ApiKeys.parse({"key": [{"key": ACME, "tenant": "acme"}, {"key": ROOT, "admin": True}]}, "test")


async def test_api_keys_name_the_tenant_and_guard_admin_routes() -> None:
    def bearer(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async with live(api_keys=KEYS) as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        r = await c.post("/generate", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (
            await c.post("/generate", json=body, headers=bearer("sk-wrong-0123456789abc"))
        ).status_code == 401
        assert (await c.post("/generate", json=body, headers=bearer(ACME))).status_code == 200
        assert backend.requests[-1].tenant == "acme"
        assert (await c.post("/generate", json=body, headers=bearer(ROOT))).status_code == 200
        assert backend.requests[-1].tenant is None
        for path in ("/flush_cache", "/metrics"):
            method = c.post if path == "/flush_cache" else c.get
            assert (await method(path, headers=bearer(ACME))).status_code == 403
            assert (await method(path, headers=bearer(ROOT))).status_code == 200
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/health")).status_code == 200

        # A plain mapping works too.
    mapping = {ACME: KEYS.lookup(ACME)}
    async with live(api_keys=mapping) as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        r = await c.post("/generate", json={"text": "hi"}, headers=bearer(ACME))
        assert r.status_code == 200 and backend.requests[-1].tenant == "acme"


async def test_an_open_door_keeps_each_callers_cache_apart_unless_told() -> None:
    """Issue 30, finding 10: without keys every caller shared one cache namespace, so one could
    time another's prompts. Each caller now has a tenant of its own (its bearer token's hash,
    else its address; the token never shows); `shared_open_cache` puts them back together."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}

    def as_caller(token: str | None) -> dict[str, str]:
        return {} if token is None else {"Authorization": f"Bearer {token}"}

    async with live() as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        tenants = []
        for token in ("sk-alice-secret", "sk-bob-secret", "sk-alice-secret", None):
            assert (await c.post("/generate", json=body, headers=as_caller(token))).status_code == 200
            tenants.append(backend.requests[-1].tenant)
        alice, bob, alice_again, anonymous = tenants
        assert alice == alice_again and len({alice, bob, anonymous}) == 3 and None not in tenants
        assert not any("secret" in t for t in tenants)  # a hash of the token, not the token
        assert anonymous == "address:127.0.0.1"
        assert (await c.post("/flush_cache", headers=as_caller("sk-bob-secret"))).status_code == 200
    async with live(shared_open_cache=True) as (url, backend), httpx2.AsyncClient(base_url=url) as c:
        for token in ("sk-alice-secret", "sk-bob-secret"):
            assert (await c.post("/generate", json=body, headers=as_caller(token))).status_code == 200
            assert backend.requests[-1].tenant is None


@pytest.mark.parametrize("api", ["chat", "generate", "whole"])
async def test_stopping_the_server_tells_the_requests_in_flight_before_closing(api: str) -> None:
    """Issue 30, finding 10: SIGTERM cut streams in flight with no error event, so a client
    took a cut answer for a whole one. Stopping (`serve_http`'s shutdown trigger, which the
    signal sets) now ends each stream with an error event (OpenAI) or an abort finish reason
    (SGLang) and [DONE], a whole answer with a 503 saying why; the server then returns."""
    backend = FakeBackend(delay_s=0.05)
    app = create_app(backend, CODEC, model_name=MODEL)
    stopping = trio.Event()
    lines: list[str] = []
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            serving = functools.partial(serve_http, shutdown_trigger=stopping.wait, graceful_timeout_s=5.0)
            port = await nursery.start(serving, app, "127.0.0.1", 0)
            async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=GUARD_S) as c:
                if api == "whole":
                    nursery.start_soon(_set_once_active, backend, stopping)
                    body = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 1000}}
                    r = await c.post("/generate", json=body)
                    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
                else:
                    path, body = (
                        (
                            "/v1/chat/completions",
                            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                        )
                        if api == "chat"
                        else ("/generate", {"text": "hello"})
                    )
                    body |= {"stream": True}
                    body |= (
                        {"max_tokens": 1000}
                        if api == "chat"
                        else {"sampling_params": {"max_new_tokens": 1000}}
                    )
                    async with c.stream("POST", path, json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                lines.append(line[6:])
                            if len(lines) == 3:
                                stopping.set()
    # the server returned: the nursery closed by itself once the response was out
    assert backend.active == set() and backend.aborted
    if api == "whole":
        return
    assert lines[-1] == "[DONE]", lines[-3:]
    last = json.loads(lines[-2])
    if api == "chat":
        assert "shutting down" in last["error"]["message"], last
    else:
        reason = last["meta_info"]["finish_reason"]
        assert reason == {"type": "abort", "message": "the server is shutting down"}, reason


async def _set_once_active(backend: FakeBackend, stopping: trio.Event) -> None:
    await poll(lambda: backend.active)
    await trio.sleep(0.1)
    stopping.set()


# ============================================================================ text pieces


@given(st.text(max_size=40), st.lists(st.integers(1, 5), max_size=40))
def test_incremental_detokenizing_shows_only_whole_characters(text: str, cuts: list[int]) -> None:
    text = text.encode("utf-8", "replace").decode("utf-8")  # no lone surrogates
    ids = CODEC.encode(text)
    detok = IncrementalDetokenizer(CODEC)
    pieces, at = [], 0
    for n in [*cuts, len(ids)]:
        pieces.append(detok.push(ids[at : at + n]))
        at += n
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text


@given(
    st.text(alphabet="abc", max_size=30),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    st.lists(st.integers(1, 4), max_size=30),
)
def test_stop_strings_cut_before_the_first_match_and_never_take_text_back(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    s = StopStrings(tuple(stops))
    shown, at, expected = "", 0, None
    for n in [*cuts, len(text)]:
        shown += s.feed(text[at : at + n])
        assert s.text == shown
        at += n
        # The oracle: text arrives piece by piece, and the first piece that completes a stop
        # string ends it there, at the earliest match so far (later text never existed).
        hits = [text[:at].find(stop) for stop in stops if stop in text[:at]]
        if hits and expected is None:
            expected = text[: min(hits)]
    shown += s.feed("", final=True)
    if expected is None:
        assert shown == text and s.matched is None
    else:
        assert (
            shown == expected
            and s.matched is not None
            and text.find(s.matched, len(expected)) == len(expected)
        )


async def test_sglang_generate_takes_stream_options_as_sglangs_own_multiturn_kit_sends_them() -> None:
    """SGLang's cache-hit kit (`sglang.test.kits.cache_hit_kit.gen_payload`) posts OpenAI's
    `stream_options` to /generate: accepted when well formed (each chunk's meta_info has the
    usage), refused by name otherwise."""
    payload = {
        "input_ids": CODEC.encode("abcdef"),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
        "stream": True,
        "stream_options": {"include_usage": True},
        "lora_path": "",
        "return_logprob": False,
        "logprob_start_len": -1,
    }
    async with live() as (url, _), httpx2.AsyncClient(base_url=url) as c:
        ok = await c.post("/generate", json=payload)
        bad = await c.post("/generate", json={**payload, "stream_options": {"include_usgae": True}})
        unstreamed = await c.post("/generate", json={**payload, "stream": False})
    lines = [json.loads(x.removeprefix("data: ")) for x in ok.text.split("\n\n") if x.startswith("data: {")]
    assert ok.status_code == 200 and lines[-1]["meta_info"]["completion_tokens"] == 3
    assert lines[-1]["meta_info"]["prompt_tokens"] == 6
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options.include_usgae"
    assert unstreamed.status_code == 400 and unstreamed.json()["error"]["param"] == "stream_options"
