"""One set of sampling limits from the HTTP front door to the sampler: whatever sampling fields a
client sends, the front door either refuses them with a 400 naming the field, or the decode node
takes the very same value off the wire; a peer's bad `sampling` field ends only its request.

The last tests run the real front door in front of a real decode node (tests/node_pair.py), so
a value the node would refuse is shown to come back as a 400, never as the node's 503.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from node_pair import GUARD_S, node_pair
from serving_fakes import ByteCodec

from hicache.runtime.serving import create_app, params, serve_http
from hicache.runtime.serving.backend import ModelInfo
from hicache.runtime.serving.errors import ApiError
from hicache.runtime.serving.node_backend import NodeBackend
from hicache.runtime.wire import protocol
from hicache.runtime.wire.sampling_fields import (
    FIELDS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    SEED_RANGE,
    Sampling,
    SamplingError,
)

VOCAB = 512  # TinyConfig's
MAX_CONTEXT = 256

# Values at and around every limit, of every JSON type, as clients send them.
_EDGES = [0, 1, -1, -2, 0.5, 1.0, 100, 100.0, 100.5, 1e4, 1e-7, 5e-324, -0.0, 2.0**31, 10**400, 1e300]
_EDGES += [MAX_TOP_K, MAX_TOP_K + 1, VOCAB, VOCAB - 1]
_EDGES += [SEED_RANGE[0], SEED_RANGE[0] - 1, SEED_RANGE[1], SEED_RANGE[1] + 1]
_SCALARS = (
    st.sampled_from(_EDGES)
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.none()
    | st.text(max_size=3)
)
_STOP_IDS = (
    st.lists(st.integers(-2, VOCAB + 2) | st.sampled_from([1.0, True, "7"]), max_size=4)
    | st.integers(MAX_STOP_TOKEN_IDS - 1, MAX_STOP_TOKEN_IDS + 1).map(lambda n: list(range(n)))
    | _SCALARS
)
_VALUES = {
    "temperature": _SCALARS,
    "top_p": _SCALARS,
    "top_k": _SCALARS,
    "seed": _SCALARS,
    "sampling_seed": _SCALARS,
    "stop_token_ids": _STOP_IDS,
    "ignore_eos": st.booleans() | _SCALARS,
    "min_p": _SCALARS,
    "presence_penalty": _SCALARS,
    "frequency_penalty": _SCALARS,
    "repetition_penalty": _SCALARS,
    "logit_bias": st.dictionaries(
        st.sampled_from(["0", "511", "512", "-1", "x", "7"]), _SCALARS | st.floats(-101, 101), max_size=3
    )
    | _SCALARS,
}


def _openai(obj: dict[str, Any]) -> params.Asked:
    return params.sampling(
        obj, max_keys=("max_tokens",), seed_keys=("seed",), vocab_size=VOCAB, max_context=MAX_CONTEXT
    )


def _sglang(obj: dict[str, Any]) -> params.Asked:
    return params.sampling(
        obj,
        max_keys=("max_new_tokens",),
        seed_keys=("seed", "sampling_seed"),
        vocab_size=VOCAB,
        max_context=MAX_CONTEXT,
        where="sampling_params.",
    )


def _over_the_wire(sampling: Sampling) -> Sampling:
    """What the decode node makes of `sampling` once the front door has sent it."""
    msg = {"op": "generate", "rid": "r", "tokens": [1], "max_new": 1, "sampling": sampling.to_wire()}
    frame = protocol.encode(msg)
    body = json.loads(frame[protocol.HEADER_SIZE :])
    return Sampling.from_wire(body["sampling"], VOCAB)


@settings(max_examples=examples(400), deadline=None)
@given(fields=st.fixed_dictionaries({}, optional=_VALUES), api=st.sampled_from(["openai", "sglang"]))
def test_the_door_refuses_a_field_by_name_or_the_node_takes_the_same_value(
    fields: dict[str, Any], api: str
) -> None:
    if api == "openai":
        fields.pop("sampling_seed", None)  # SGLang's name only
    where = "sampling_params." if api == "sglang" else ""
    try:
        asked = (_sglang if api == "sglang" else _openai)(fields)
    except ApiError as exc:
        assert exc.status == 400
        assert exc.param is not None and exc.param.startswith(where), exc.param
        key = exc.param.removeprefix(where)
        assert key in fields, (exc.param, fields)
        assert exc.message.startswith(f"'{exc.param}' must be ") and ", not " in exc.message, exc.message
        return
    spec = asked.spec
    assert _over_the_wire(spec) == spec
    assert spec.check(VOCAB) is spec
    # What was asked is what the node draws with (SGLang's top_k -1 is "no limit", stored as 0).
    seed = next((fields[k] for k in ("seed", "sampling_seed") if fields.get(k) is not None), None)
    assert spec.seed == seed
    top_k = fields.get("top_k")
    assert spec.top_k == (0 if top_k is None or top_k == -1 else top_k)
    temperature = fields.get("temperature")
    assert spec.temperature == (1.0 if temperature is None else temperature)
    assert spec.stop_token_ids == tuple(fields.get("stop_token_ids") or ())


@settings(max_examples=examples(300), deadline=None)
@given(raw=st.fixed_dictionaries({}, optional={**_VALUES, "sampling_seed": _SCALARS, "min_p": _SCALARS}))
def test_a_peers_sampling_field_is_taken_whole_or_refused_by_name(raw: dict[str, Any]) -> None:
    try:
        got = Sampling.from_wire(raw, VOCAB)
    except protocol.MessageError as exc:
        if "sampling_seed" in raw:  # the front door's name, never the wire's
            assert "unknown key 'sampling_seed'" in str(exc)
            return
        named = [f for f in FIELDS if f"field 'sampling.{f}' must be " in str(exc)]
        assert len(named) == 1 and named[0] in raw, str(exc)
        return
    assert "sampling_seed" not in raw
    assert _over_the_wire(got) == got
    assert got.to_wire().keys() == set(FIELDS)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ([1], "field 'sampling' must be an object"),
        ({"temperatur": 1.0}, "unknown key 'temperatur'"),
        ({"temperature": MAX_TEMPERATURE + 1}, "field 'sampling.temperature' must be a number in [0, 100]"),
        ({"top_p": 0}, "field 'sampling.top_p' must be a number in (0, 1], got 0.0"),
        ({"stop_token_ids": [VOCAB]}, f"token ids in [0, {VOCAB})"),
        ({"seed": "7"}, "field 'sampling.seed'"),
    ],
)
def test_a_bad_wire_field_is_a_message_error_naming_it(raw: object, says: str) -> None:
    with pytest.raises(protocol.MessageError) as caught:
        Sampling.from_wire(raw, VOCAB, "kv")
    assert says in str(caught.value) and str(caught.value).startswith("message 'kv': "), caught.value


@pytest.mark.parametrize(
    ("fields", "field", "value"),
    [
        ({"temperature": -0.1}, "temperature", -0.1),
        ({"temperature": math.nan}, "temperature", math.nan),
        ({"temperature": True}, "temperature", True),
        ({"top_p": 1.5}, "top_p", 1.5),
        ({"top_k": -2}, "top_k", -2),
        ({"top_k": 1.5}, "top_k", 1.5),
        ({"min_p": 1.0}, "min_p", 1.0),
        ({"seed": 2**64}, "seed", 2**64),
        ({"stop_token_ids": (-1,)}, "stop_token_ids", (-1,)),
        ({"ignore_eos": 1}, "ignore_eos", 1),
    ],
)
def test_a_value_out_of_its_limits_names_the_field_the_range_and_the_value(
    fields: dict[str, Any], field: str, value: object
) -> None:
    with pytest.raises(SamplingError) as caught:
        Sampling(**fields)
    exc = caught.value
    assert (exc.field, repr(exc.value)) == (field, repr(value))
    assert str(exc).startswith(f"'{field}' must be ") and repr(value) in str(exc) and exc.expected in str(exc)


def test_limits_hold_exactly_at_their_edges() -> None:
    edge = Sampling(
        temperature=MAX_TEMPERATURE,
        top_p=1,
        top_k=MAX_TOP_K,
        seed=SEED_RANGE[1],
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
    )
    assert edge.check(VOCAB) == edge and edge.temperature == 100.0 and type(edge.top_p) is float
    assert Sampling(seed=SEED_RANGE[0], top_k=-1, top_p=5e-324).top_k == 0
    assert (
        Sampling(seed=7.0, top_k=3.0).to_wire() == Sampling(seed=7, top_k=3).to_wire()  # JSON's 7.0
    )
    with pytest.raises(SamplingError, match="stop_token_ids"):
        Sampling(stop_token_ids=[VOCAB]).check(VOCAB)
    with pytest.raises(SamplingError, match="stop_token_ids"):
        Sampling(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))


# --------------------------------------------------------------- the front door before a real node


@asynccontextmanager
async def front_door(tmp_path: Path, **pair: Any) -> AsyncIterator[httpx2.AsyncClient]:
    """The real app on a loopback port, its backend a real decode node (and its prefill node,
    `pair` passed to `node_pair`)."""
    async with node_pair(tmp_path, **pair) as pair:
        port = pair.client.stream.socket.getpeername()[1]
        info = ModelInfo("tiny", MAX_CONTEXT, (), VOCAB)
        backend = NodeBackend("127.0.0.1", port, info)
        app = create_app(backend, ByteCodec(), model_name="tiny")
        async with trio.open_nursery() as nursery:
            http_port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=GUARD_S) as c:
                yield c
            await backend.aclose()
            nursery.cancel_scope.cancel()


async def test_a_prompt_prefill_refuses_as_it_is_is_a_400_at_the_door(tmp_path: Path) -> None:
    """Prefill's staging pool (4 pages of 16) cannot send a 100-token prompt's KV: the decode
    node marks the failure `refused`, and the door answers 400 with prefill's sentence, once,
    streaming or not; a prompt that fits is served after it."""
    async with front_door(tmp_path, prefill={"staging_pages": 4}) as c:
        for path, body in [
            ("/generate", {"text": "x" * 100, "sampling_params": {"max_new_tokens": 2}}),
            ("/v1/completions", {"model": "tiny", "prompt": "y" * 100, "max_tokens": 2, "stream": True}),
        ]:
            got = await c.post(path, json=body)
            assert got.status_code == 400, got.text
            error = got.json()["error"]
            assert error["code"] == "request_refused" and "--staging-pages" in error["message"], error
        got = await c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert got.status_code == 200, got.text


REFUSED_BY_THE_NODE_BEFORE = [  # each passed the old front door and came back as a 503
    ("/v1/completions", {"temperature": 200}, 400, "temperature"),
    ("/generate", {"temperature": 1e4}, 400, "sampling_params.temperature"),
    ("/v1/completions", {"temperature": 0.7, "seed": -5}, 200, None),
    ("/v1/completions", {"temperature": 0.7, "top_k": 100_000, "seed": 2**63}, 200, None),
    ("/generate", {"stop_token_ids": list(range(VOCAB - MAX_STOP_TOKEN_IDS, VOCAB))}, 200, None),
    ("/generate", {"temperature": 0.9, "top_p": 0.5, "top_k": -1, "sampling_seed": 3}, 200, None),
]


@pytest.mark.parametrize(("path", "fields", "status", "param"), REFUSED_BY_THE_NODE_BEFORE)
async def test_sampling_the_node_would_refuse_is_a_400_at_the_door_never_a_503(
    tmp_path: Path, path: str, fields: dict[str, Any], status: int, param: str | None
) -> None:
    if path == "/generate":
        body: dict[str, Any] = {"text": "hello there", "sampling_params": {"max_new_tokens": 3, **fields}}
    else:
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 3, **fields}
    async with front_door(tmp_path) as c:
        got = await c.post(path, json=body)
        assert got.status_code == status, got.text
        if status == 400:
            error = got.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["param"] == param and error["message"].startswith(f"'{param}' must be "), error
        elif path == "/generate":
            assert 1 <= len(got.json()["output_ids"]) <= 3  # a stop token id may end it early
        else:
            assert got.json()["usage"]["completion_tokens"] == 3
        again = await c.post(
            "/generate", json={"text": "still here", "sampling_params": {"max_new_tokens": 2}}
        )
        assert again.status_code == 200, again.text  # the node is still serving


async def test_a_bad_sampling_field_from_a_peer_ends_that_request_and_the_node_goes_on(
    tmp_path: Path,
) -> None:
    async with node_pair(tmp_path) as pair:
        client = pair.client
        bad = {"op": "generate", "rid": "bad", "tokens": [1, 2, 3], "max_new": 2, "sampling": {"top_p": 2}}
        with trio.fail_after(GUARD_S), pytest.raises(protocol.ProtocolError) as caught:
            await client.call(bad)
        assert "field 'sampling.top_p' must be a number in (0, 1], got 2.0" in str(caught.value)
        sampled = Sampling(temperature=0.8, top_k=50, seed=-3).to_wire()
        runs = []
        for n in range(2):
            msg = {**bad, "rid": f"ok-{n}", "sampling": sampled}
            with trio.fail_after(GUARD_S):
                reply, _ = await client.call(msg)
                await client.idle()
            assert reply["outcome"] == "finished", reply
            runs.append(reply["tokens"])
        assert runs[0] == runs[1] and len(runs[0]) == 2  # one seed, one draw, on this same connection
