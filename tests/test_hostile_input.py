"""Hostile input at every boundary: each reader either accepts its input or refuses it the way it
documents — an error that names where the problem is — and never fails some other way, hangs,
allocates what a peer merely claims, or touches a file it should not.

- Trace readers (Mooncake JSONL, Azure CSV, kv-cache-tester JSON): any line, row or document is
  read or raises `TraceError` naming the file and line (and the field, for a JSON object). Unknown
  keys in a trace are ignored: real traces carry extra columns.
- The scenario loader: any file (TOML text, broken TOML, not text at all) loads or raises
  `ScenarioError` naming the file; unknown keys are errors there (the README says so).
- The control protocol: any byte stream yields frames, `EOFError` at a clean end, or
  `ProtocolError`; a frame's claimed length is never allocated before its bytes arrive. A
  decode node answers malformed client messages with an error frame and keeps serving.
- The TCP transfer engine as an initiator, facing a target that answers with anything: the
  transfer ends `DONE` only on a valid answer, else `ERR`, and the engine keeps working
  (`tests/test_transfer.py` covers the target side).
- The file store's keys: only ints in [0, 2**64) and 16 hex digits are keys; anything else is a
  `ValueError` before any file is touched, and no key names a path outside the store's root.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import tempfile
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import trio
import trio.testing
from builders import examples as profile_examples
from hypothesis import HealthCheck, Phase, event, example, given, settings
from node_pair import exchange, stand_in_hello
from transfer_peer import recv_exactly, wire_accept

from hicache.core.config import DecodeConfig
from hicache.runtime.decode.decode_node import DecodeService
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.storage import FileStore, MemoryStore
from hicache.runtime.storage.base import KEY_LIMIT, key_value
from hicache.runtime.transfer import MemoryRegion, PeerInfo, TcpEngine, XferState
from hicache.runtime.transfer.tcp_wire import HEADER, MAGIC, VERSION, Msg, encode_header
from hicache.runtime.wire import protocol
from hicache.scenarios.scenario import Scenario, ScenarioError, load_scenario
from hicache.scenarios.traces import (
    MAX_TOKENS,
    TraceError,
    read_azure_csv,
    read_kv_cache_tester,
    read_mooncake,
)

GUARD_S = 10  # a guard against hangs, never a speed assertion
FIELD_NAMED = "field '"
NO_FIXTURE_CHECK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


def fuzz(examples: int) -> settings:
    """Hypothesis settings for these properties (no "explain" phase: it reruns failing
    examples hundreds of times, each of which may start engines or nodes)."""
    return settings(
        max_examples=profile_examples(examples),  # scaled by the hypothesis profile
        deadline=None,
        suppress_health_check=NO_FIXTURE_CHECK,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    )


def scratch() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="hicache-hostile-")


def deep(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


# Values that break readers in practice: huge and negative numbers, more digits than Python
# converts by default, non-finite floats, nesting deeper than the recursion limit, wrong types.
HUGE_DIGITS = "9" * 5000
JSON_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 511, 512, 513, 2**31 - 1, 2**31, 2**63, 2**64, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-3, 2**41), max_size=4),
    st.lists(st.one_of(st.booleans(), st.floats(), st.text(max_size=2)), min_size=1, max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
RAW_VALUES = st.sampled_from([HUGE_DIGITS, "-" + HUGE_DIGITS, deep(50_000), "1e400", "-1e400", "NaN", "[1,"])


def json_value_text() -> st.SearchStrategy[str]:
    return st.one_of(JSON_VALUES.map(json.dumps), RAW_VALUES)


# ============================================================================ trace readers

MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
GOOD_MOONCAKE = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}'


@st.composite
def mooncake_lines(draw: st.DrawFn) -> tuple[str | bytes, bool]:
    """One physical line: a JSON object with some fields replaced, added or dropped, raw bytes
    (maybe not UTF-8), or a JSON value that is not an object. Returns (line, is_object)."""
    kind = draw(st.sampled_from(["object", "object", "object", "bytes", "value"]))
    if kind == "bytes":
        return draw(st.binary(max_size=60).map(lambda b: b.replace(b"\n", b" ").replace(b"\r", b" "))), False
    if kind == "value":
        return draw(json_value_text()), False
    fields = {k: json.dumps(v) for k, v in json.loads(GOOD_MOONCAKE).items()}
    for key in draw(st.lists(st.sampled_from(MOONCAKE_KEYS), max_size=3, unique=True)):
        if draw(st.booleans()):
            fields[key] = draw(json_value_text())
        else:
            del fields[key]
    for key in draw(st.lists(st.text(max_size=5), max_size=2)):
        fields[key] = draw(json_value_text())  # unknown keys
    text = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items()) + "}"
    cut = draw(st.none() | st.integers(0, len(text)))
    return (text if cut is None else text[:cut]), cut is None


@pytest.mark.slow
@fuzz(300)
@given(line=mooncake_lines(), before=st.integers(0, 3), after=st.booleans())
def test_mooncake_reads_or_names_the_line(line: tuple[str | bytes, bool], before: int, after: bool) -> None:
    text, is_object = line
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    body = (GOOD_MOONCAKE + "\n").encode() * before + raw + b"\n" + (GOOD_MOONCAKE.encode() + b"\n") * after
    with scratch() as tmp:
        path = Path(tmp) / "trace.jsonl"
        path.write_bytes(body)
        try:
            requests = read_mooncake(path)
        except TraceError as exc:
            event("refused")
            assert str(exc).startswith(f"{path}:{before + 1}: "), str(exc)[:300]
            if is_object and not any(s in str(exc) for s in ("not a JSON object", "not UTF-8")):
                assert FIELD_NAMED in str(exc), str(exc)[:300]
            return
    event("read")
    assert len(requests) in (before + after, before + after + 1)  # a blank line is skipped
    for r in requests:
        assert 0 <= r.arrival < math.inf and 1 <= r.input_length < MAX_TOKENS and r.output_length >= 0
        assert r.block_ids is not None and len(r.block_ids) == math.ceil(r.input_length / 512)


def test_mooncake_ignores_unknown_keys(tmp_path: Path) -> None:
    plain, extra = tmp_path / "plain.jsonl", tmp_path / "extra.jsonl"
    plain.write_text(GOOD_MOONCAKE + "\n")
    extra.write_text(GOOD_MOONCAKE[:-1] + ', "session": "s", "x": [1, {"y": null}]}\n')
    assert read_mooncake(extra) == read_mooncake(plain)


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
GOOD_AZURE = "2023-11-16 18:15:46.6805900,374,44"
AZURE_CELLS = st.one_of(
    st.sampled_from(
        [
            "2023-11-16 18:15:50",
            "2023-11-16T18:15:50+05:00",  # an aware time among naive ones
            "2023-11-16 18:15:50Z",
            "2023-02-30 00:00:00",
            "0",
            "-5",
            "374",
            "1" * 40,
            HUGE_DIGITS,
            "9" * 200_000,  # longer than the csv module's field limit
            "\x00",
            "",
            "nan",
            "1e3",
        ]
    ),
    st.integers(-(2**40), 2**70).map(str),
    st.text(st.characters(blacklist_characters='\n\r",'), max_size=12),
)


@pytest.mark.slow
@fuzz(200)
@given(
    cells=st.lists(AZURE_CELLS, min_size=0, max_size=4),
    before=st.integers(0, 2),
    garbage=st.none() | st.binary(min_size=1, max_size=8).map(lambda b: b.replace(b"\n", b"")),
)
def test_azure_reads_or_names_the_line(cells: list[str], before: int, garbage: bytes | None) -> None:
    row = ",".join(cells).encode("utf-8", "surrogatepass")  # a lone surrogate: bytes that are not UTF-8
    if garbage is not None:
        row += garbage.replace(b"\r", b"")
    body = (AZURE_HEADER + "\n" + (GOOD_AZURE + "\n") * before).encode() + row + b"\n"
    with scratch() as tmp:
        path = Path(tmp) / "trace.csv"
        path.write_bytes(body)
        try:
            requests = read_azure_csv(path)
        except TraceError as exc:
            event("refused")
            assert str(exc).startswith(f"{path}:{before + 2}: "), str(exc)[:300]
            return
    event("read")
    for r in requests:
        assert math.isfinite(r.arrival)
        assert 1 <= r.input_length < MAX_TOKENS and 0 <= r.output_length < MAX_TOKENS, r


def kvct_requests(depth: int) -> st.SearchStrategy[list[Any]]:
    field_value = st.one_of(JSON_VALUES, st.just(None))
    plain = st.fixed_dictionaries(
        {"t": st.one_of(st.floats(0, 100), field_value), "in": st.one_of(st.integers(1, 200), field_value)},
        optional={
            "out": st.one_of(st.integers(0, 10), field_value),
            "hash_ids": field_value,
            "zz": field_value,
        },
    )
    if depth == 0:
        return st.lists(plain, max_size=3)
    sub = st.fixed_dictionaries(
        {"t": st.floats(0, 10), "type": st.just("subagent"), "requests": kvct_requests(depth - 1)}
    )
    return st.lists(st.one_of(plain, sub, field_value), max_size=3)


@fuzz(150)
@given(
    doc=st.fixed_dictionaries(
        {"block_size": st.one_of(st.just(64), JSON_VALUES), "requests": kvct_requests(2)},
        optional={"id": JSON_VALUES},
    ),
    damage=st.sampled_from(["none", "none", "cut", "bytes", "deep_json", "deep_subagents"]),
    data=st.data(),
)
def test_kv_cache_tester_reads_or_names_the_file(doc: dict[str, Any], damage: str, data: Any) -> None:
    text = json.dumps(doc)
    if damage == "cut":
        text = text[: data.draw(st.integers(0, len(text)))]
    elif damage == "deep_json":
        text = text[:-1] + ', "x": ' + deep(50_000) + "}"
    elif damage == "deep_subagents":
        nested = '{"t": 0, "type": "subagent", "requests": [' * 3000 + "]}" * 3000
        text = '{"block_size": 64, "requests": [' + nested + "]}"
    raw = text.encode() if damage != "bytes" else text.encode() + data.draw(st.binary(min_size=1, max_size=4))
    with scratch() as tmp:
        path = Path(tmp) / "session.json"
        path.write_bytes(raw)
        try:
            requests = read_kv_cache_tester(path)
        except TraceError as exc:
            event(f"refused ({damage})")
            assert str(exc).startswith(str(path)), str(exc)[:300]
            return
    event(f"read ({damage})")
    for r in requests:
        assert math.isfinite(r.arrival) and r.arrival >= 0
        assert 1 <= r.input_length < MAX_TOKENS and 0 <= r.output_length < MAX_TOKENS


# ============================================================================ scenario files

SECTIONS = ("workload", "model", "hardware", "storage", "cluster", "cache", "run", "faults")
SOME_KEYS = {
    "workload": ("kind", "tenants", "conversations", "turns", "user_tokens", "path", "rate", "vocab"),
    "model": ("preset", "name", "layers", "kv_heads", "q_heads", "params"),
    "hardware": ("gpu", "gpus_per_node", "mem_fraction"),
    "storage": ("bandwidth", "latency", "capacity_tokens"),
    "cluster": ("prefill_nodes", "router", "tick_interval", "prefill_cache"),
    "cache": ("page_size", "l1_tokens", "hicache_ratio", "promise", "prefetch_policy", "eviction"),
    "run": ("baselines", "until"),
    "faults": ("seed", "l3_get", "load", "transfer", "timer"),
}
TOML_SCALARS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(
        [
            HUGE_DIGITS,
            "0x" + "f" * 30,
            "1e400",
            "-inf",
            "nan",
            "1979-05-27T07:32:00Z",
            "07:32:00",
            "true",
            '"lru"',
            '"eager"',
            '"multiturn"',
            '"trace"',
            '"\\u0000"',
            "''",
            "[]",
            "[1, 2]",
            "[16, 8]",
            '["l1", "l1"]',
            "{}",
            "{ a = 1 }",
            '{ kind = "error", rate = 0.01 }',
            '{ kind = "delay", rate = 0.5, seconds = [2, 1] }',
            '[{ kind = "partial", rate = 0.7 }, { kind = "error", rate = 0.7 }]',
            '{ kind = "peer_death", rate = -1 }',
            deep(3000),
            "[" * 3000,
        ]
    ),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=8).map(json.dumps),
)


@st.composite
def toml_files(draw: st.DrawFn) -> bytes:
    """A scenario file: mostly well-formed TOML with known and unknown sections and keys and
    wrong or out-of-range values, sometimes broken TOML or bytes that are not text."""
    kind = draw(st.sampled_from(["toml", "toml", "toml", "cut", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=80))
    lines = []
    if draw(st.booleans()):
        lines.append(f"seed = {draw(TOML_SCALARS)}")
    for section in draw(
        st.lists(
            st.sampled_from(SECTIONS) | st.from_regex(r"[a-z]{1,6}", fullmatch=True), max_size=3, unique=True
        )
    ):
        lines.append(f"[{section}]")
        known = SOME_KEYS.get(section, ())
        keys = (
            st.sampled_from(known) | st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
            if known
            else st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
        )
        for key in draw(st.lists(keys, max_size=3, unique=True)):
            lines.append(f"{key} = {draw(TOML_SCALARS)}")
    text = "\n".join(lines) + "\n"
    if kind == "cut":
        text = text[: draw(st.integers(0, len(text)))]
    return text.encode("utf-8", "surrogatepass")


@pytest.mark.slow
@fuzz(300)
@given(raw=toml_files())
def test_any_scenario_file_loads_or_is_a_scenario_error_naming_the_file(raw: bytes) -> None:
    with scratch() as tmp:
        path = Path(tmp) / "hostile.toml"
        path.write_bytes(raw)
        try:
            scenario = load_scenario(path)
        except ScenarioError as exc:
            event("refused")
            assert str(exc).startswith(str(path)), str(exc)[:300]
            return
    event("loaded")
    assert isinstance(scenario, Scenario)


# ============================================================================ control protocol

LIMIT = 4096  # the readers under test take at most this much JSON and binary per frame


# JSON that once escaped the frame reader as another exception: nested past the recursion
# limit (RecursionError), a number of more digits than Python converts (ValueError).
UNPARSABLE_BODIES = [
    ('{"op": "x", "v": ' + deep(1000) + "}").encode(),
    ('{"op": "x", "v": ' + deep(100_000) + "}").encode(),
    ('{"op": "x", "v": ' + "[" * 100_000).encode(),
    b'{"op": "x", "n": ' + b"9" * 4301 + b"}",
    b'{"op": "x", "n": -' + b"1" * 4301 + b"}",
]


@st.composite
def control_streams(draw: st.DrawFn) -> tuple[bytes, dict[str, Any] | None, bytes]:
    """A frame with some fields replaced by lies (magic, version, lengths), maybe cut short.
    Returns the bytes and, when the frame is intact and valid, what it carries."""
    obj = draw(
        st.one_of(
            st.fixed_dictionaries(
                {"op": st.text(max_size=8)}, optional={"rid": JSON_VALUES, "n": JSON_VALUES}
            ),
            st.dictionaries(st.text(max_size=3), JSON_VALUES, max_size=2),
            JSON_VALUES,
        )
    )
    body = draw(st.one_of(st.just(json.dumps(obj).encode()), st.binary(max_size=24)))
    binary = draw(st.binary(max_size=48))
    lies = draw(st.sets(st.sampled_from(["magic", "version", "json_len", "bin_len", "cut"]), max_size=2))
    magic = draw(st.binary(min_size=4, max_size=4)) if "magic" in lies else protocol.MAGIC
    version = draw(st.integers(0, 255)) if "version" in lies else protocol.VERSION
    n_json = draw(st.integers(0, 2**32 - 1)) if "json_len" in lies else len(body)
    n_bin = draw(st.integers(0, 2**64 - 1)) if "bin_len" in lies else len(binary)
    frame = struct.pack("<4sBIQ", magic, version, n_json, n_bin) + body + binary
    if "cut" in lies:
        frame = frame[: draw(st.integers(0, len(frame) - 1))]
    valid = (
        not lies
        and isinstance(obj, dict)
        and isinstance(obj.get("op"), str)
        and body == json.dumps(obj).encode()
    )
    return frame, (obj if valid else None), binary


def same(a: tuple[Any, bytes], b: tuple[Any, bytes]) -> bool:
    """Equal frames (JSON compared as text: NaN is not equal to itself)."""
    return json.dumps(a[0], sort_keys=True) == json.dumps(b[0], sort_keys=True) and a[1] == b[1]


def whole_frame(body: bytes) -> bytes:
    """An honest frame around `body`."""
    return struct.pack("<4sBIQ", protocol.MAGIC, protocol.VERSION, len(body), 0) + body


@pytest.mark.slow
@fuzz(300)
@given(stream=control_streams(), chunk=st.integers(1, 64), trailing=st.booleans())
async def test_any_byte_stream_gives_frames_eof_or_a_protocol_error(
    stream: tuple[bytes, dict[str, Any] | None, bytes], chunk: int, trailing: bool
) -> None:
    frame, obj, binary = stream
    data = frame + (protocol.encode({"op": "next"}) if trailing else b"")
    send, receive = trio.testing.memory_stream_one_way_pair()
    for i in range(0, len(data), chunk):  # any fragmentation
        await send.send_all(data[i : i + chunk])
    await send.aclose()
    reader = protocol.FrameReader(receive, max_json=LIMIT, max_binary=LIMIT)
    tracemalloc.start()
    try:
        with trio.fail_after(GUARD_S):
            got = await reader.receive()
    except EOFError:
        event("eof")
        assert data == b""
        return
    except protocol.ProtocolError:
        event("protocol error")
        assert obj is None
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 4 * LIMIT + (1 << 20), f"reading one frame allocated {peak} bytes"
    event("frame")
    magic, version, n_json, n_bin = struct.unpack("<4sBIQ", data[:17])
    assert magic == protocol.MAGIC and version == protocol.VERSION and n_json <= LIMIT and n_bin <= LIMIT
    assert same(got, (json.loads(data[17 : 17 + n_json]), data[17 + n_json : 17 + n_json + n_bin]))
    if obj is not None:
        assert same(got, (obj, binary))
        if trailing:  # the reader kept what arrived past the frame
            with trio.fail_after(GUARD_S):
                assert await reader.receive() == ({"op": "next"}, b"")


async def test_a_lying_length_is_not_allocated_before_its_bytes_arrive() -> None:
    """A peer announces a large binary tail (within the limit) and sends ten bytes: the reader
    must not reserve the announced size up front. Over a real socket, where a read of N bytes
    allocates N."""
    a, b = trio.socket.socketpair()
    async with trio.SocketStream(a) as sender, trio.SocketStream(b) as receiver:
        claimed = 256 << 20
        await sender.send_all(
            struct.pack("<4sBIQ", protocol.MAGIC, protocol.VERSION, 2, claimed) + b"{}" + b"x" * 10
        )
        await sender.send_eof()
        reader = protocol.FrameReader(receiver)
        assert reader.max_binary >= claimed
        tracemalloc.start()
        try:
            with trio.fail_after(GUARD_S), pytest.raises(protocol.ProtocolError, match="inside a frame"):
                await reader.receive()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 16 << 20, f"a frame claiming {claimed} bytes made the reader allocate {peak} bytes"


@pytest.mark.parametrize("body", UNPARSABLE_BODIES, ids=lambda b: f"{b[:24]!r}...{len(b)}B")
async def test_json_the_parser_refuses_is_a_protocol_error(body: bytes) -> None:
    """Deep nesting and over-long integers end as `ProtocolError`, like any other bad JSON
    (a decode node's connection handler expects nothing else; they once stopped it). Not a
    hypothesis property: hypothesis raises the recursion limit while a test runs, so JSON
    nested 1,000 deep would parse there."""
    send, receive = trio.testing.memory_stream_one_way_pair()
    await send.send_all(whole_frame(body) + protocol.encode({"op": "next"}))
    await send.aclose()
    reader = protocol.FrameReader(receive)
    with trio.fail_after(GUARD_S), pytest.raises(protocol.ProtocolError, match="JSON"):
        await reader.receive()


@fuzz(200)
@given(value=JSON_VALUES, kind=st.sampled_from([str, int, list, bool]))
def test_message_fields_are_the_right_type_or_a_protocol_error(value: Any, kind: type) -> None:
    msg = {"op": "x", "f": value}
    try:
        got = protocol.field(msg, "f", kind)
    except protocol.ProtocolError as exc:
        assert "'f'" in str(exc)
    else:
        assert isinstance(got, kind) and (kind is bool or not isinstance(got, bool))
    try:
        ints = protocol.int_list(msg, "f", low=0, high=512)
    except protocol.ProtocolError as exc:
        assert "'f'" in str(exc)
    else:
        assert all(type(v) is int and 0 <= v < 512 for v in ints)


# ---------------------------------------------------------------------------- a decode node's clients


@contextlib.asynccontextmanager
async def decode_node() -> AsyncIterator[int]:
    """A decode node in this process, connected to a stand-in prefill node that only says hello
    (no message below ever reaches prefill); yields the node's client port."""
    model = TinyConfig()
    cfg = DecodeConfig(l1_pages=32, l2_pages=32, page_size=4, decode_reserve_tokens=4)
    async with TcpEngine(name="prefill-stand-in") as prefill, TcpEngine(name="decode") as engine:

        async def hello(stream: trio.SocketStream) -> None:
            reader = protocol.FrameReader(stream, max_binary=0)
            msg = await stand_in_hello(stream, reader)
            await prefill.add_peer(bytes.fromhex(msg["info"]))
            hello = {"op": "hello", "info": prefill.local_info().hex(), "profile": msg.get("profile")}
            await protocol.send(stream, hello)
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, hello, 0)
            prefill_port = listeners[0].socket.getsockname()[1]
            layout = layout_for(model, cfg.page_size)
            service = DecodeService(cfg, TinyModel(model), layout, MemoryStore(layout), engine)
            port = await nursery.start(service.run, 0, ("127.0.0.1", prefill_port))
            yield port
            nursery.cancel_scope.cancel()


CLIENT_FIELDS = st.dictionaries(
    st.sampled_from(["rid", "tokens", "max_new", "tenant", "verify", "l1", "l2", "zz"]),
    st.one_of(JSON_VALUES, st.lists(st.integers(-2, 600), max_size=3)),
    max_size=4,
)


@st.composite
def client_messages(draw: st.DrawFn) -> bytes:
    op = draw(st.sampled_from(["generate", "evict", "stats", "idle", "nope"]) | st.text(max_size=4))
    msg = {"op": op, **draw(CLIENT_FIELDS)}
    rid, tokens, max_new = msg.get("rid"), msg.get("tokens"), msg.get("max_new")
    well_formed_generate = (
        op == "generate"
        and isinstance(rid, str)
        and isinstance(tokens, list)
        and tokens
        and all(type(t) is int and 0 <= t < 512 for t in tokens)
        and type(max_new) is int
        and max_new >= 1
    )
    if well_formed_generate:
        msg["max_new"] = 0  # a real request would need a real prefill node: keep it malformed
    if draw(st.booleans()):
        return protocol.encode(msg)
    raw = json.dumps(msg).encode()
    return draw(st.sampled_from([raw, protocol.encode(msg)[: len(raw) // 2], b"\0" * 17 + raw]))


@fuzz(15)
@given(messages=st.lists(client_messages(), min_size=1, max_size=12))
@example(
    messages=[protocol.encode({"op": "evict", "l1": "all"}), protocol.encode({"op": "evict", "l2": None})]
)
@example(messages=[protocol.encode({"op": "generate", "rid": 5, "tokens": [1], "max_new": 1})])
async def test_a_decode_node_answers_malformed_client_messages_and_keeps_serving(
    messages: list[bytes],
) -> None:
    async with decode_node() as port:
        for data in messages:
            replies = await exchange(port, data)
            assert replies, "the node hung up without an answer"
            assert all(isinstance(r.get("op"), str) for r in replies)
            assert replies[-1]["op"] in ("error", "evict", "stats", "idle", "result"), replies
        (stats,) = await exchange(port, protocol.encode({"op": "stats"}))
        assert stats["op"] == "stats" and stats["arrived"] == 0


# ============================================================================ TCP transfer engine

PAGES, PAGE_BYTES = 8, 256


@st.composite
def target_replies(draw: st.DrawFn) -> tuple[str, int, bytes, dict[str, Any]]:
    """A transfer and what a hostile target answers: its HELLO answer (the valid handshake, or
    one with a wrong proof, or anything else), then its answer to the request, with up to two
    fields replaced (a wrong type, transfer id, magic, version, count, page size, notification
    length, a short payload), each maybe cut short by a hang-up."""
    op = draw(st.sampled_from(["WRITE", "READ"]))
    pages = draw(st.integers(0, 4))
    fields = ("hello", "type", "xid", "magic", "version", "name", "count", "page_bytes", "notif_len", "tail")
    broken = draw(st.sets(st.sampled_from(fields), max_size=2))

    def pick(key: str, valid: Any, wild: st.SearchStrategy[Any]) -> Any:
        return draw(wild) if key in broken else valid

    some_header = st.builds(
        encode_header, st.sampled_from(list(Msg)), st.integers(0, 3), st.binary(max_size=6)
    )
    reads = op == "READ"
    answer = dict(
        type=pick(
            "type", Msg.READ_DATA if reads else Msg.ACK, st.sampled_from(list(Msg)) | st.integers(9, 255)
        ),
        xid=pick("xid", "right", st.just("wrong")),
        magic=pick("magic", MAGIC, st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC)),
        version=pick("version", VERSION, st.integers(0, 255).filter(lambda v: v != VERSION)),
        name=pick("name", b"", st.binary(min_size=1, max_size=4)),
        count=pick("count", "right" if reads else 0, st.sampled_from([0, 1, 5, 2**32 - 1, "right"])),
        page_bytes=pick(
            "page_bytes", "right" if reads else 0, st.sampled_from([0, PAGE_BYTES + 1, 2**64 - 1])
        ),
        notif_len=pick("notif_len", 0, st.sampled_from([3, 2**16 + 1, 2**32 - 1])),
        tail=pick("tail", pages * PAGE_BYTES if reads else 0, st.integers(0, 4 * PAGE_BYTES + 8)),
    )
    wrong_proof = st.builds(
        lambda proof: encode_header(Msg.HELLO_ACK, 0, b"fake", notif_len=48) + proof,
        st.binary(min_size=48, max_size=48),
    )
    hello = pick("hello", VALID_HELLO, st.binary(max_size=40) | some_header | wrong_proof)
    return op, pages, hello, answer


VALID_HELLO = b"the valid handshake"  # the target answers HELLO as a real engine would


@pytest.mark.slow
@fuzz(80)
@given(reply=target_replies())
async def test_tcp_initiator_survives_any_answer_from_its_target(
    reply: tuple[str, int, bytes, dict[str, Any]],
) -> None:
    op, pages, hello, f = reply
    local = np.arange(PAGES * PAGE_BYTES, dtype=np.uint8).reshape(PAGES, PAGE_BYTES) % 251
    before = local.copy()
    sent_pages: list[bytes] = []

    async def target(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
            if hello == VALID_HELLO:
                assert await wire_accept(stream, b"fake") == b"init"
            else:
                head = await recv_exactly(stream, HEADER.size)
                _, _, _, name_len, _, _, _, notif_len = HEADER.unpack(head)
                await recv_exactly(stream, name_len + notif_len)
                await stream.send_all(hello)
                await stream.send_eof()  # said its piece: a silent peer is only bounded by `wait`
            _, _, mtype, name_len, xid, count, _, notif_len = HEADER.unpack(
                await recv_exactly(stream, HEADER.size)
            )
            await recv_exactly(stream, name_len + 4 * count + notif_len)
            if mtype == Msg.WRITE:
                await recv_exactly(stream, count * PAGE_BYTES)
            n = count if f["count"] == "right" else f["count"]
            pb = PAGE_BYTES if f["page_bytes"] == "right" else f["page_bytes"]
            xid = xid if f["xid"] == "right" else xid + 1
            out = HEADER.pack(f["magic"], f["version"], f["type"], len(f["name"]), xid, n, pb, f["notif_len"])
            body = bytes((7 * i + 3) % 256 for i in range(f["tail"]))
            sent_pages.extend(body[i : i + PAGE_BYTES] for i in range(0, len(body), PAGE_BYTES))
            await stream.send_all(out + f["name"] + body)
            await stream.send_eof()
            while await stream.receive_some(HEADER.size):  # until the initiator hangs up
                pass
        await stream.aclose()

    async with (
        TcpEngine(name="init") as engine,
        TcpEngine(name="real") as real,
        trio.open_nursery() as nursery,
    ):
        listeners = await nursery.start(trio.serve_tcp, target, 0)
        port = listeners[0].socket.getsockname()[1]
        fields = {"host": b"127.0.0.1", "port": port.to_bytes(2, "little")}
        info = PeerInfo("tcp", "fake", fields, (MemoryRegion("pool", 0, PAGE_BYTES, PAGES),)).encode()
        region = engine.register("src", local)
        await engine.add_peer(info)
        handle = await engine.post(op, region, range(pages), "fake", "pool", range(pages), b"n")
        with trio.fail_after(GUARD_S):
            state = await engine.wait(handle, timeout=GUARD_S)
        event(f"{op} {state}")
        header_ok = (f["magic"], f["version"], f["xid"], f["notif_len"]) == (MAGIC, VERSION, "right", 0)
        if op == "WRITE":
            no_pages = f["count"] == 0 or (f["count"] == "right" and pages == 0)
            answer_ok = header_ok and f["type"] == Msg.ACK and no_pages and f["page_bytes"] == 0
        else:
            sizes = f["count"] in ("right", pages) and f["page_bytes"] == "right"
            answer_ok = header_ok and f["type"] == Msg.READ_DATA and sizes and f["tail"] >= pages * PAGE_BYTES
        valid = hello == VALID_HELLO and answer_ok
        if valid:
            assert state is XferState.DONE, engine.reason(handle)
        else:
            assert state is XferState.ERR and engine.reason(handle)
        if op == "READ" and state is XferState.DONE:
            assert [bytes(local[i]) for i in range(pages)] == sent_pages[:pages]
        else:
            assert np.array_equal(local, before) or op == "READ"  # a WRITE never changes its source
        engine.release(handle)
        # The engine still works: a WRITE to a well-behaved peer completes.
        dst = np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8)
        real.register("pool", dst)
        await engine.add_peer(real.local_info())
        await real.add_peer(engine.local_info())
        ok = await engine.post("WRITE", region, [0, 1], "real", "pool", [5, 6], b"ok")
        with trio.fail_after(GUARD_S):
            assert await engine.wait(ok, timeout=GUARD_S) is XferState.DONE
        assert np.array_equal(dst[[5, 6]], local[[0, 1]])
        nursery.cancel_scope.cancel()


# ============================================================================ file store keys

LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=8, page_size=4, dtype="float32")  # 256-byte pages
HOSTILE_KEYS = st.one_of(
    st.text(max_size=24),
    st.sampled_from(
        [
            "../x",
            "../../etc/passwd",
            "/etc/passwd",
            "/tmp/x" + "0" * 10,
            "..",
            ".",
            "",
            "0123456789abcde\x00",
            "\x000123456789abcdef",
            "0123456789abcdef\n",
            " 0123456789abcdef",
            "0x0123456789abcd",
            "０１２３４５６７８９ａｂｃｄｅｆ",  # full-width digits and letters
            "٠١٢٣٤٥٦٧٨٩٠١٢٣٤٥",  # Arabic-Indic digits
            "0123456789abcdef/..",
            "ffffffffffffffff0",
        ]
    ),
    st.from_regex(r"[0-9a-fA-F]{16}", fullmatch=True),
    st.text("0123456789abcdefABCDEF./\\\x00", min_size=14, max_size=18),
    st.integers(-(2**80), 2**80),
    st.sampled_from([0, 2**64 - 1, 2**64, -1, True, False, np.bool_(True), None, 1.0, math.nan, b"0" * 16]),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.binary(max_size=16),
    st.lists(st.integers(0, 9), max_size=2),
)


def valid_key(key: object) -> int | None:
    """What a key must mean, from the documented rule alone."""
    if isinstance(key, bool | np.bool_):
        return None
    if isinstance(key, int | np.integer):
        return int(key) if 0 <= int(key) < 2**64 else None
    if isinstance(key, str) and len(key) == 16 and all(c in "0123456789abcdefABCDEF" for c in key):
        return int(key, 16)
    return None


@pytest.mark.slow
@fuzz(300)
@given(key=HOSTILE_KEYS)
def test_only_documented_keys_are_keys_and_they_stay_under_the_root(key: object) -> None:
    want = valid_key(key)
    with scratch() as tmp:
        root = Path(tmp) / "l3"
        store = FileStore(root, LAYOUT)
        try:
            value = key_value(key)
        except ValueError as exc:
            event("refused")
            assert want is None, f"{key!r} is a valid key but was refused: {exc}"
            assert "page key" in str(exc)
            with pytest.raises(ValueError, match="page key"):
                store.path(key)
            return
        event("accepted")
        assert want == value and 0 <= value < KEY_LIMIT
        path = store.path(key)
        assert path == root / f"{value:016x}"[:2] / f"{value:016x}.kvpage"
        assert os.path.normpath(path) == str(path) and path.is_relative_to(root)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@fuzz(80)
@given(keys=st.lists(HOSTILE_KEYS, min_size=1, max_size=3))
async def test_a_batch_with_a_bad_key_touches_no_file(keys: list[object]) -> None:
    with scratch() as tmp:
        base = Path(tmp)
        root = base / "inner" / "l3"
        (base / "outside.txt").write_bytes(b"keep")
        store = FileStore(root, LAYOUT)
        pool = KVPool(LAYOUT, 4)
        pool.bytes_view().fill_(7)
        batch = [0x0123456789ABCDEF, *keys]
        pages = list(range(len(batch)))
        before = snapshot(base)
        if any(valid_key(k) is None for k in keys):
            event("a bad key in the batch")
            for call in (store.exists(batch), store.get(batch, pool, pages), store.put(batch, pool, pages)):
                with pytest.raises(ValueError, match="page key"):
                    await call
            assert snapshot(base) == before
            return
        event("all keys valid")
        values = {valid_key(k) for k in batch}
        if len(values) == len(batch):
            await store.put(batch, pool, pages)
            after = snapshot(base)
            added = set(after) - set(before)
            assert added == {str(store.path(v).relative_to(base)) for v in values}
            assert all((base / name).resolve().is_relative_to(root.resolve()) for name in added)
            assert after["outside.txt"] == b"keep"
        await store.aclose()
