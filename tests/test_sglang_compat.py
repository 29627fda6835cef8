"""What SGLang's own clients and dashboards read, checked against SGLang's source rather than our
encoder: /metrics names, types, label and buckets; /server_info, /model_info and /ready; batches,
stop-token trimming and `no_stop_trim` on /generate; and --served-model-name's aliases.

The app runs in this process on a loopback port with tests/serving_fakes.py's FakeBackend, which
answers a prompt with the prompt's own tokens.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import trio
from prometheus_client.parser import text_string_to_metric_families
from serving_fakes import EOS, ByteCodec, FakeBackend

from hicache.runtime.serving import create_app, serve_http
from hicache.runtime.serving.admission import Admission
from hicache.runtime.serving.backend import CUMULATIVE_STATS

MODEL = "fake-echo"
CODEC = ByteCodec()

# Taken from SGLang's python/sglang/srt/observability/metrics_collector.py (sgl-project/sglang at
# 44cedc2b9c7dd31d9acae4498ea4fa0d3665feed; the same names are in the older
# python/sglang/srt/metrics/collector.py), as declared there: name -> Prometheus type. Counters are
# declared with their `_total` suffix there; the exposition's family name drops it.
SGLANG_TYPES = {
    "sglang:prompt_tokens_total": "counter",
    "sglang:generation_tokens_total": "counter",
    "sglang:cached_tokens_total": "counter",
    "sglang:num_requests_total": "counter",
    "sglang:num_aborted_requests_total": "counter",
    "sglang:num_retracted_requests_total": "counter",
    "sglang:time_to_first_token_seconds": "histogram",
    "sglang:inter_token_latency_seconds": "histogram",
    "sglang:e2e_request_latency_seconds": "histogram",
    "sglang:queue_time_seconds": "histogram",
    "sglang:num_running_reqs": "gauge",
    "sglang:num_queue_reqs": "gauge",
    "sglang:cache_hit_rate": "gauge",
    "sglang:token_usage": "gauge",
    "sglang:num_used_tokens": "gauge",
    "sglang:max_total_num_tokens": "gauge",
    "sglang:cache_config_info": "gauge",
    # HiRadixCache's host-pool gauges (read by AIPerf's cpu_kv_cache_usage panel)
    "sglang:hicache_host_used_tokens": "gauge",
    "sglang:hicache_host_total_tokens": "gauge",
}
# SGLang's default buckets there: TokenizerMetricsCollector's and SchedulerMetricsCollector's.
# Older SGLang names that clients still read, beside the current ones: AIPerf 0.13 takes its
# preemptions from `sglang:num_retracted_reqs_total` (a counter).
OLDER_TYPES = {"sglang:num_retracted_reqs_total": "counter"}

SGLANG_BUCKETS = {
    "sglang:time_to_first_token_seconds": [
        0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
    ],
    "sglang:e2e_request_latency_seconds": [
        0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400,
    ],
    "sglang:inter_token_latency_seconds": [
        0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
        0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
    ],
    "sglang:queue_time_seconds": [
        0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400,
        500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
    ],
}  # fmt: skip
NODE_STATS = {  # what a decode node reports (runtime/decode/status.py), some of it cumulative
    "requests_running": 2.0,
    "requests_waiting": 1.0,
    "l1_pages_used": 32.0,
    "l1_pages": 128.0,
    "l2_pages_used": 10.0,
    "l2_pages": 256.0,
    "max_total_tokens": 128 * 16.0,
    "arrived": 7.0,
    "retracted": 1.0,
    "transfer_bytes": 4096.0,
}


@contextlib.asynccontextmanager
async def live(backend: FakeBackend, **kwargs: Any) -> AsyncIterator[str]:
    app = create_app(backend, CODEC, model_name=MODEL, **kwargs)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, app, "127.0.0.1", 0)
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_every_sglang_series_has_sglangs_name_type_label_and_buckets() -> None:
    backend = FakeBackend(stats_value=dict(NODE_STATS))
    async with live(backend, admission=Admission(4, 4)) as url, httpx2.AsyncClient(base_url=url) as c:
        body = {"text": "a prompt of some length", "sampling_params": {"max_new_tokens": 3}}
        for _ in range(2):
            assert (await c.post("/generate", json=body)).status_code == 200
        text = (await c.get("/metrics")).text
    families = _families(text)
    for name, kind in SGLANG_TYPES.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert family in families, (name, sorted(families))
        assert families[family].type == kind, (name, families[family].type)
        if name != "sglang:cache_config_info":  # labelled by page size, as SGLang's
            assert all(s.labels.get("model_name") == MODEL for s in families[family].samples), name
    for name, buckets in SGLANG_BUCKETS.items():
        bounds = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert bounds == [*map(float, buckets), float("inf")], name
    ours = {n for n in families if n.startswith("sglang:") and not n.endswith("_created")}  # the library's
    known = SGLANG_TYPES | OLDER_TYPES
    assert ours <= {n.removesuffix("_total") if known[n] == "counter" else n for n in known}

    def value(name: str, **labels: str) -> float:
        return next(s.value for s in families[name].samples if labels.items() <= s.labels.items())

    prompt = 2 * len(body["text"])
    assert value("sglang:prompt_tokens", model_name=MODEL) == prompt
    assert value("sglang:cached_tokens", cache_source="device") == len(body["text"])
    assert value("sglang:cache_hit_rate") == len(body["text"]) / prompt
    assert value("sglang:token_usage") == 32 / 128
    assert value("sglang:num_used_tokens") == 32 * 16
    assert value("sglang:hicache_host_total_tokens") == 256 * 16
    assert value("sglang:num_running_reqs") == 2  # the node's decoding batch
    assert value("sglang:num_queue_reqs") == 1  # nothing queued at the front door, one at the node
    assert value("sglang:cache_config_info", page_size="16", num_pages="128") == 1
    assert value("sglang:num_retracted_requests") == 1
    assert value("sglang:num_retracted_reqs") == 1 and families["sglang:num_retracted_reqs"].type == "counter"
    # the node's cumulative stats are counters, its levels gauges
    assert families["hicache_backend_arrived"].type == "counter"
    assert families["hicache_backend_transfer_bytes"].type == "counter"
    assert families["hicache_backend_l1_pages_used"].type == "gauge"


def test_every_cumulative_node_stat_is_declared_a_counter() -> None:
    import attrs

    from hicache.core.decode_base import NodeStats
    from hicache.runtime.decode.status import MOVED

    cumulative = {f.name for f in attrs.fields(NodeStats)} - {"max_loads_in_flight"} | set(MOVED)
    assert cumulative <= CUMULATIVE_STATS
    assert not CUMULATIVE_STATS & {
        "requests_running",
        "l1_pages_used",
        "l2_pages_used",
        "max_loads_in_flight",
    }


async def test_server_info_model_info_and_ready_under_sglangs_routes() -> None:
    async with (
        live(FakeBackend(), admission=Admission(8, 2, max_tokens=4096), page_size=64) as url,
        httpx2.AsyncClient(base_url=url) as c,
    ):
        for path in ("/server_info", "/get_server_info"):
            info = (await c.get(path)).json()
            assert info["page_size"] == 64 and info["max_total_num_tokens"] == 4096, info
            assert info["served_model_name"] == MODEL and info["model_path"] == "fake/byte-echo"
            assert (
                info["max_running_requests"] == 8
                and info["internal_states"][0]["avg_spec_accept_length"] is None
            )
        for path in ("/model_info", "/get_model_info"):
            model = (await c.get(path)).json()
            assert model["model_path"] == "fake/byte-echo" and model["is_generation"] is True
            assert model["has_image_understanding"] is False and model["weight_version"] == "default"
        assert (await c.get("/ready")).status_code == 200


async def test_a_batch_of_texts_or_ids_gets_a_list_each_with_its_own_meta_info() -> None:
    backend = FakeBackend()
    async with live(backend) as url, httpx2.AsyncClient(base_url=url) as c:
        r = await c.post(
            "/generate",
            json={"text": ["abc", "wxyz"], "sampling_params": {"max_new_tokens": 2}, "rid": ["one", "two"]},
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert [o["text"] for o in out] == ["ab", "wx"]
        assert [o["meta_info"]["id"] for o in out] == ["one", "two"]
        assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 4]
        r = await c.post(
            "/generate",
            json={
                "input_ids": [[*b"abc"], [*b"de"]],
                "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 3}],
            },
        )
        out = r.json()
        assert [o["text"] for o in out] == ["a", "ded"]
        assert [o["meta_info"]["finish_reason"] for o in out] == [
            {"type": "length", "length": 1},
            {"type": "length", "length": 3},
        ]
        assert len(backend.requests) == 4 and len({q.rid for q in backend.requests}) == 4
        # a single list of ids is one prompt, as SGLang reads it
        one = await c.post(
            "/generate", json={"input_ids": [*b"hi"], "sampling_params": {"max_new_tokens": 2}}
        )
        assert one.json()["text"] == "hi"


async def test_a_stop_token_is_trimmed_from_the_text_unless_no_stop_trim() -> None:
    async with live(FakeBackend()) as url, httpx2.AsyncClient(base_url=url) as c:
        stop = {"stop_token_ids": [ord("c")], "max_new_tokens": 10}
        out = (await c.post("/generate", json={"text": "abcdef", "sampling_params": stop})).json()
        assert out["text"] == "ab" and out["output_ids"] == [*b"abc"]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ord("c")}
        kept = await c.post(
            "/generate", json={"text": "abcdef", "sampling_params": stop | {"no_stop_trim": True}}
        )
        assert kept.json()["text"] == "abc"
        words = {"stop": "two", "ignore_eos": True, "max_new_tokens": 20}
        out = (await c.post("/generate", json={"text": "one two one", "sampling_params": words})).json()
        assert out["text"] == "one "
        kept = await c.post(
            "/generate", json={"text": "one two one", "sampling_params": words | {"no_stop_trim": True}}
        )
        assert kept.json()["text"] == "one two"
        eos = await c.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 5}})
        assert eos.status_code == 200
    async with live(FakeBackend(eos_after=2)) as url, httpx2.AsyncClient(base_url=url) as c:
        out = (
            await c.post("/generate", json={"text": "abcd", "sampling_params": {"no_stop_trim": True}})
        ).json()
        assert out["text"] == "ab" and out["output_ids"][-1] == EOS  # EOS is special: it has no text


def _aliases(url: str) -> tuple[list[str], str, int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    listed = [m.id for m in client.models.list()]
    reply = client.completions.create(model="alias-b", prompt="hello", max_tokens=2)
    try:
        client.completions.create(model="nobody", prompt="hello", max_tokens=2)
    except openai.NotFoundError as exc:
        return listed, reply.choices[0].text, exc.status_code
    return listed, reply.choices[0].text, 200


async def test_served_model_names_are_aliases_clients_may_send_and_v1_models_lists() -> None:
    async with live(FakeBackend(), aliases=("alias-b", MODEL)) as url:
        listed, text, refused = await trio.to_thread.run_sync(_aliases, url)
    assert listed == [MODEL, "alias-b"] and text == "he" and refused == 404


async def test_bench_multiturns_own_payload_is_taken_as_it_is_sent() -> None:
    """SGLang's benchmark/hicache/bench_multiturn.py `gen_payload`, key for key: its neutral
    `lora_path`, `return_logprob` and `logprob_start_len` pass the unknown-key and
    not-supported checks."""
    payload = {
        "text": "a prompt",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
        "stream": True,
        "lora_path": "",
        "return_logprob": False,
        "logprob_start_len": -1,
    }
    async with live(FakeBackend()) as url, httpx2.AsyncClient(base_url=url) as c:
        async with c.stream("POST", "/generate", json=payload) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["text"] == "a pr"
        assert (await c.post("/flush_cache")).status_code == 200
