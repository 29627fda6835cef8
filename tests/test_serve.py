"""`hicache serve` on the default model (SmolLM2-135M-Instruct), driven by the `openai` package
and SGLang's wire format: answers, streaming, cached tokens by tier over a conversation, abort on
disconnect with nothing left held, and 4xx for bad requests. Real processes throughout: a
prefill and a decode node started as an operator would (the decode node with an admin key), and
`hicache serve --decode` attached to them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
import trio
from helpers import NodeProcess, hicache, running

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.storage.page_file import HEADER, HEADER_SIZE
from hicache.runtime.wire.client import DecodeClient

pytestmark = [pytest.mark.process, pytest.mark.real_model]

PAGE = 16
READY_S = 600  # loading the default model on a loaded machine: a guard, never a speed assertion
ADMIN = "sk-test-admin-0123456789"
SYSTEM = (
    "You are a geography tutor. Answer in one short sentence, name the country, and never use "
    "more than twenty words. Be precise about capitals, rivers and mountains."
)


class Stack:
    def __init__(self, url: str, decode: tuple[str, int], procs: list[NodeProcess], l3: Path) -> None:
        self.url, self.decode, self.procs, self.l3 = url, decode, procs, l3
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def audit(self) -> dict[str, Any]:
        async def ask() -> dict[str, Any]:
            client = await DecodeClient.connect(*self.decode, api_key=ADMIN)
            try:
                await client.idle()
                return (await client.call({"op": "audit"}))[0]
            finally:
                await client.aclose()

        return trio.run(ask)

    def stats(self) -> dict[str, Any]:
        async def ask() -> dict[str, Any]:
            client = await DecodeClient.connect(*self.decode, api_key=ADMIN)
            try:
                return await client.stats()
            finally:
                await client.aclose()

        return trio.run(ask)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("serve")
    keys = tmp / "keys.toml"
    keys.write_text(f'[[key]]\nkey = "{ADMIN}"\nadmin = true\n')
    keys.chmod(0o600)
    with contextlib.ExitStack() as procs:  # stopped last to first
        # Where and in what it computes, as SGLang's flags say it (the default model's own dtype).
        common = ["--engine", "tcp", "--model", "default", "--page-size", str(PAGE)]
        common += ["--device", "cpu", "--dtype", "bfloat16"]
        prefill = procs.enter_context(running("prefill", *common, logs=tmp, timeout=READY_S))
        decode_args = ["--prefill", f"127.0.0.1:{prefill.port}", "--api-keys", str(keys)]
        decode_args += ["--l1-pages", "128", "--l2-pages", "128", "--storage-dir", str(tmp / "l3")]
        decode_args += ["--prefetch-threshold-tokens", str(PAGE), "--decode-reserve-tokens", str(2 * PAGE)]
        decode = procs.enter_context(running("decode", *common, *decode_args, logs=tmp, timeout=READY_S))
        serve = ["--decode", f"127.0.0.1:{decode.port}", "--decode-api-key", ADMIN]
        front = procs.enter_context(running(*serve, command=("serve",), logs=tmp, timeout=READY_S))
        yield Stack(front.info["url"], ("127.0.0.1", decode.port), [prefill, decode, front], tmp / "l3")


def chat(stack: Stack, messages: list[dict[str, str]], **kw: Any) -> Any:
    return stack.client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, **kw
    )


def test_an_open_front_door_says_so_once_at_start(stack: Stack) -> None:
    """Issue 30, finding 10: a front door without --api-keys started without a word."""
    said = [line for line in stack.procs[2].stderr().splitlines() if "no --api-keys" in line]
    assert len(said) == 1 and "each caller's cache is its own" in said[0], said


def test_the_nodes_say_where_they_compute(stack: Stack) -> None:
    for node in stack.procs[:2]:
        assert node.info["device"] == "cpu", node.info


def test_the_model_answers_through_the_openai_client(stack: Stack) -> None:
    reply = chat(stack, [{"role": "user", "content": "What is the capital of France?"}], max_tokens=20)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 0 and reply.usage.prompt_tokens_details is not None
    chunks = list(
        chat(
            stack,
            [{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content  # greedy: the same answer
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    )
    done = stack.client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The capital of Italy is", max_tokens=5, temperature=0
    )
    assert done.choices[0].text.strip() and done.usage.completion_tokens <= 5
    assert [m.id for m in stack.client.models.list().data] == ["SmolLM2-135M-Instruct"]


def sglang(stack: Stack, text: str, max_new: int = 12) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
    got = httpx.post(f"{stack.url}/generate", json=body, timeout=120)
    assert got.status_code == 200, got.text
    return got.json()


def test_a_conversations_later_turns_report_cached_tokens_by_tier(stack: Stack) -> None:
    """SGLang's wire format, as its multi-turn benchmark sends it: each turn is the history so
    far plus a question. Turn 2 finds turn 1's pages in L1; after /flush_cache empties L1 and
    L2, turn 3 restores them from L3."""
    history = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    turns = []
    for question in ("Where is Paris?", "And Rome?", "And Madrid?"):
        history += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        reply = sglang(stack, history)
        turns.append(reply["meta_info"])
        history += reply["text"] + "<|im_end|>\n"
        if len(turns) == 2:
            flushed = httpx.post(f"{stack.url}/flush_cache", timeout=60)
            assert flushed.status_code == 200, flushed.text
            stack.audit()  # waits until the node is idle: stores to L3 are done
    first, second, third = turns
    assert first["cached_tokens"] == 0
    assert second["cached_tokens_details"]["l1"] >= 2 * PAGE, second
    assert third["cached_tokens_details"]["l3"] >= 2 * PAGE, third
    assert third["cached_tokens_details"]["l1"] == 0, third


def test_a_client_that_leaves_mid_stream_aborts_and_the_node_holds_nothing(stack: Stack) -> None:
    before = stack.stats()["aborted"]
    body = {
        "text": "Count from one to a thousand:",
        "sampling_params": {"max_new_tokens": 400},
        "stream": True,
    }
    with httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=120) as response:
        lines = response.iter_lines()
        seen = [line for _, line in zip(range(3), lines, strict=False)]
        assert any(line.startswith("data: {") for line in seen), seen
    deadline = time.monotonic() + 60  # a guard against hangs, not a speed assertion
    while stack.stats()["aborted"] == before:
        assert time.monotonic() < deadline, "the decode node never saw the abort"
        time.sleep(0.1)
    audit = stack.audit()
    assert audit["check"] == "ok", audit
    for key in ("l1_leaked", "l2_leaked", "locks", "pins", "live", "reserved"):
        assert audit[key] == 0, audit


def test_the_decode_nodes_l3_pages_are_sealed_with_its_cluster_secret(stack: Stack) -> None:
    """Issue 30, finding 1: the node's pages are 0600 and sealed with keys from its cluster
    secret (here HICACHE_CLUSTER_SECRET, which the tests set), and no key lies beside them."""
    chat(stack, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Lima?"}])
    deadline = time.monotonic() + 60  # a guard: backups reach L3 after the request ends
    while not (pages := sorted(stack.l3.rglob("*.kvpage"))):
        assert time.monotonic() < deadline, "no page reached L3"
        time.sleep(0.1)
    assert not [p for p in stack.l3.rglob("*") if "secret" in p.name]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in pages)
    header = pages[0].read_bytes()[:HEADER_SIZE]
    _, _, _, _, _, key, layers, _, page_size, kv_heads, head_dim, dtype, *_ = HEADER.unpack(header)
    layout = KVLayout(layers, kv_heads, head_dim, page_size, dtype.rstrip(b"\0").decode())
    right = FileStore(stack.l3, layout, secret=ClusterSecret.load().key)
    wrong = FileStore(stack.l3, layout, secret=os.environ["HICACHE_CLUSTER_SECRET"])  # not derived
    assert trio.run(right.get, [key], KVPool(layout, 1), [0]) == 1
    assert trio.run(wrong.get, [key], KVPool(layout, 1), [0]) == 0
    for store in (right, wrong):
        trio.run(store.aclose)


def test_sigterm_tells_a_stream_in_flight_before_the_front_door_exits(stack: Stack, tmp_path: Path) -> None:
    """Issue 30, finding 10: SIGTERM cut streams in flight with no error event. A second front
    door on the same decode node is sent SIGTERM mid-stream: the stream ends with OpenAI's error
    object and [DONE], and the process exits 0."""
    serve = ["--decode", f"127.0.0.1:{stack.decode[1]}", "--decode-api-key", ADMIN]
    with running(*serve, command=("serve",), logs=tmp_path, name="front2", timeout=READY_S) as front:
        url = front.info["url"]
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "Count from one to a thousand."}],
            "max_tokens": 400,
            "stream": True,
        }
        data: list[str] = []
        signalled = False
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                if len(data) == 3 and not signalled:
                    front.proc.send_signal(signal.SIGTERM)  # once: blank lines follow each event
                    signalled = True
        assert front.proc.wait(60) == 0
    assert data[-1] == "[DONE]", data[-3:]
    assert "shutting down" in json.loads(data[-2])["error"]["message"], data[-2]


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "gpt-4",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi " * 40_000, "max_tokens": 4}, 400, "tokens"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
        ("/generate", {"text": 5}, 400, "text"),
        ("/generate", "{not json", 400, "JSON"),
    ],
)
def test_a_bad_request_gets_a_4xx_naming_the_problem(
    stack: Stack, path: str, body: Any, status: int, says: str
) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    got = httpx.post(
        f"{stack.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60
    )
    assert got.status_code == status, got.text
    assert says.lower() in got.json()["error"]["message"].lower(), got.text
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200  # still serving


def test_metrics_count_requests_and_carry_the_decode_nodes_gauges(stack: Stack) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    sglang(stack, "Name a river in France.", max_new=4)
    got = httpx.get(f"{stack.url}/metrics", timeout=30)
    assert got.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(got.text)
        for s in family.samples
    }
    names = {name for name, _ in samples}
    assert sum(v for (n, _), v in samples.items() if n == "hicache_requests_total") >= 1
    for gauge in ("l1_pages_used", "l1_pages", "requests_running"):
        assert f"hicache_backend_{gauge}" in names, sorted(names)
    for counter in ("transfer_bytes", "restore_bytes", "arrived"):  # cumulative: counters
        assert f"hicache_backend_{counter}_total" in names, sorted(names)
    assert samples[("hicache_backend_l1_pages", ())] == 128
    assert samples[("hicache_backend_transfer_bytes_total", ())] > 0
    by_name = {n: (dict(labels), v) for (n, labels), v in samples.items()}
    assert by_name["sglang:cache_config_info"] == ({"page_size": str(PAGE), "num_pages": "128"}, 1.0)
    assert by_name["sglang:max_total_num_tokens"][1] == 128 * PAGE


# The stack's decode node holds 128 L1 pages less 2 reserved: prompts of at most 126 pages.
POOL_LIMIT = (128 - 2) * PAGE


def test_the_context_length_is_the_models_own(tmp_path: Path) -> None:
    from hicache.runtime.serve import load_model_source

    assert load_model_source("default").context_length == 8192  # the GGUF's llama.context_length


def test_the_limit_reported_is_the_models_capped_by_what_the_pool_holds(stack: Stack) -> None:
    assert POOL_LIMIT < 8192  # this stack's L1 is the tighter bound
    models = httpx.get(f"{stack.url}/v1/models", timeout=30).json()["data"]
    assert [m["max_model_len"] for m in models] == [POOL_LIMIT]
    info = httpx.get(f"{stack.url}/get_model_info", timeout=30).json()
    assert info["max_context_tokens"] == POOL_LIMIT
    assert httpx.get(f"{stack.url}/get_server_info", timeout=30).json()["context_length"] == POOL_LIMIT


def _content_of(prompt_tokens: int) -> list[dict[str, str]]:
    """A chat whose prompt, with the chat template, is `prompt_tokens` tokens long."""
    from hicache.runtime.serve import load_tokenizer

    tokenizer, _ = load_tokenizer("default")
    words = prompt_tokens
    while True:
        messages = [{"role": "user", "content": "sun " * words}]
        n = len(tokenizer.encode_chat(messages, add_generation_prompt=True))
        if n == prompt_tokens:
            return messages
        words += prompt_tokens - n


def test_an_over_long_prompt_is_a_400_before_the_node_sees_it(stack: Stack) -> None:
    arrived = stack.stats()["arrived"]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(stack, _content_of(POOL_LIMIT + 1), max_tokens=1)
    assert f"holds at most {POOL_LIMIT} tokens" in str(refused.value)
    assert stack.stats()["arrived"] == arrived  # no work started for it


def test_a_chat_without_max_tokens_gets_the_room_left_in_the_context(stack: Stack) -> None:
    room = 6
    reply = chat(stack, _content_of(POOL_LIMIT - room), extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == POOL_LIMIT - room
    assert reply.usage.completion_tokens == room and reply.choices[0].finish_reason == "length"


def test_the_exported_tokenizer_loads_in_transformers_and_encodes_alike(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from hicache.runtime.serve import load_tokenizer

    out = tmp_path / "tokenizer"
    done = hicache("serve", "--export-tokenizer", str(out), timeout=120)
    assert done.returncode == 0, done.stderr
    theirs = AutoTokenizer.from_pretrained(out)
    ours, _ = load_tokenizer("default")
    messages = [{"role": "user", "content": "Où est la tour Eiffel? 🗼"}]
    text = "Where is the Eiffel tower?\n  Tabs\tand ünïcödé 🗼"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    assert theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == ours.render_chat(messages)
