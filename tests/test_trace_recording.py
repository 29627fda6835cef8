"""Recording the traffic the front door serves as a Mooncake trace without its text
(runtime/serving/trace_recorder.py): the block ids' chaining and tenant isolation, the lines
re-read by the simulator's reader and `hicache trace stats`, the admin endpoints, a write error
that ends the recording and never a request, and one run of the real `hicache serve`.

The backend is tests/serving_fakes.py's FakeBackend (it answers a prompt with its own tokens).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import json
import math
import os
import subprocess
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx2
import pytest
import trio
from builders import examples
from helpers import running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_fakes import EOS, ByteCodec, FakeBackend

from hicache.cli import main as cli_main
from hicache.runtime.security.api_keys import ApiKeys
from hicache.runtime.serving import create_app, serve_http, trace_recorder
from hicache.runtime.serving.backend import GenerateRequest, Sampling
from hicache.runtime.serving.generation import Generation, Job
from hicache.runtime.serving.metrics import Metrics
from hicache.runtime.serving.trace_recorder import BlockIds, Recording, TraceRecorder, config_header
from hicache.scenarios.traces import MOONCAKE_BLOCK, read_mooncake, read_trace_header

B = MOONCAKE_BLOCK
MODEL_SERVED = "SmolLM2-135M-Instruct"  # `hicache serve`'s default model
MODEL = "fake-echo"
GUARD_S = 20  # a guard against hangs, never a speed assertion
ACME = "sk-acme-0123456789abcdef"
ROOT = "sk-root-0123456789abcdef"
KEYS = ApiKeys.parse({"key": [{"key": ACME, "tenant": "acme"}, {"key": ROOT, "admin": True}]}, "test")

# A prompt as blocks: each block is one token value repeated (cheap to make long prompts whose
# blocks are equal or differ at will), the last one possibly partial.
blocks = st.lists(st.integers(0, 5), min_size=1, max_size=5)
tails = st.integers(0, B - 1)


def prompt(values: list[int], tail: int) -> list[int]:
    full = [v for v in values[:-1] for _ in range(B)]
    return full + [values[-1]] * (tail or B)


# ============================================================================ block ids


@given(blocks, tails, blocks, tails)
def test_block_ids_are_chained_one_per_block_with_a_partial_last(
    a: list[int], ta: int, b: list[int], tb: int
) -> None:
    ids = BlockIds(MODEL)
    pa, pb = prompt(a, ta), prompt(b, tb)
    ia, ib = ids.ids(pa, None), ids.ids(pb, None)
    assert len(ia) == math.ceil(len(pa) / B) and len(ib) == math.ceil(len(pb) / B)
    assert ids.ids(pa, None) == ia  # the same prompt again: the same ids
    shared = 0  # leading token blocks the two prompts have in common (whole blocks only)
    while (
        shared < min(len(ia), len(ib))
        and pa[shared * B : (shared + 1) * B] == pb[shared * B : (shared + 1) * B]
    ):
        shared += 1
    assert ia[:shared] == ib[:shared]
    # From the first block that differs on, no id is shared: an id names its whole prefix.
    assert not set(ia[shared:]) & set(ib[shared:])
    assert len(set(ia)) == len(ia)  # each names a different prefix, even of equal blocks


@given(blocks, tails, st.sampled_from([None, "acme", "globex", ""]), st.sampled_from(["acme", "globex", ""]))
def test_tenants_never_share_ids_even_for_the_same_prompt(
    values: list[int], tail: int, one: str | None, other: str
) -> None:
    ids = BlockIds(MODEL)
    tokens = prompt(values, tail)
    mine, theirs = ids.ids(tokens, one), ids.ids(tokens, other)
    if one == other:
        assert mine == theirs
    else:
        assert not set(mine) & set(theirs)


def test_ids_are_small_integers_in_first_seen_order() -> None:
    ids = BlockIds(MODEL)
    assert ids.ids(prompt([1, 2, 3], 7), None) == [0, 1, 2]
    assert ids.ids(prompt([1, 2, 4], 0), None) == [0, 1, 3]
    assert ids.ids(prompt([9], 5), "acme") == [4]
    assert len(ids) == 5


# ============================================================================ the recording


def run_one(backend: FakeBackend, rec: Recording, req: GenerateRequest) -> Generation:
    gen = Generation(backend, ByteCodec(), Metrics(), Job("generate", req), (EOS,), on_end=rec.record)

    async def drain() -> None:
        async for _ in gen.run():
            pass

    trio.run(drain)
    return gen


def request(
    rid: str, tokens: list[int], max_new: int, tenant: str | None, session: str = ""
) -> GenerateRequest:
    return GenerateRequest(rid, tokens, max_new, Sampling(), tenant, session)


HEADER = {"model": MODEL, "page_size": 16}


@settings(
    max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(blocks, tails, st.integers(1, 6), st.sampled_from([None, "acme", "globex"])),
        min_size=1,
        max_size=6,
    )
)
def test_a_recorded_file_reads_back_as_the_requests_served(
    tmp_path: Path, served: list[tuple[list[int], int, int, str | None]]
) -> None:
    path = tmp_path / f"t{uuid.uuid4().hex}.jsonl"
    rec = TraceRecorder(MODEL, header=HEADER).start(path)
    backend = FakeBackend()
    prompts = [(prompt(v, t), n, tenant) for v, t, n, tenant in served]
    for i, (tokens, n, tenant) in enumerate(prompts):
        run_one(backend, rec, request(f"r{i}", tokens, n, tenant, session=f"s{i % 2}"))
    rec.close()
    got = read_mooncake(path)
    assert [(r.input_length, r.output_length) for r in got] == [(len(p), n) for p, n, _ in prompts]
    arrivals = [r.arrival for r in got]
    assert arrivals[0] >= 0 and arrivals == sorted(arrivals)  # one after another: in arrival order
    # Equal prompts of one tenant carry equal ids; of two tenants, none in common.
    for (pa, _, ta), ra in zip(prompts, got, strict=True):
        for (pb, _, tb), rb in zip(prompts, got, strict=True):
            assert (ra.block_ids == rb.block_ids) == (pa == pb and ta == tb)
            if ta != tb:
                assert not set(ra.block_ids or ()) & set(rb.block_ids or ())
    header = read_trace_header(path)
    assert header is not None and header["hicache_trace_header"] == 1 and header["page_size"] == 16
    assert header["block_size"] == B
    lines = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    for line, (_, _, tenant) in zip(lines, prompts, strict=True):
        assert line["finish_reason"] == "length" and set(line["cached_tokens"]) == {"l1", "l2", "l3"}
        assert ("tenant" in line) == (tenant is not None)
        if tenant is not None:
            assert tenant not in json.dumps(line)  # a salted hash, never the name
    # Sessions are numbered per tenant and session name, in first-seen order.
    named = [(p[2], f"s{i % 2}") for i, p in enumerate(prompts)]
    assert [line["session_id"] for line in lines] == [
        sorted(set(named), key=named.index).index(n) for n in named
    ]
    hashed = {p[2]: {line.get("tenant")} for line, p in zip(lines, prompts, strict=True)}
    for line, p in zip(lines, prompts, strict=True):
        hashed[p[2]].add(line.get("tenant"))
    assert all(len(h) == 1 for h in hashed.values())  # one tenant, one hash
    assert len({h.pop() for h in hashed.values()}) == len(hashed)  # two tenants, two hashes
    assert rec.requests == len(prompts)


def test_long_session_strings_are_not_kept(tmp_path: Path) -> None:
    """Issue 30, finding 8: 60 requests with distinct 2 MB `user` strings grew the recorder by
    125 MB (it kept every string as a key). It keeps a 16-byte hash of each now."""
    rec = TraceRecorder(MODEL, header=HEADER).start(tmp_path / "t.jsonl")
    run_one(FakeBackend(), rec, request("warm", [1, 2, 3], 1, "acme", session="warm-up"))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(60):
            session = f"{i:02d}" + "u" * (2 << 20)
            run_one(FakeBackend(), rec, request(f"r{i}", [1, 2, 3], 1, "acme", session=session))  # keeps none
            del session
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    rec.close()
    assert held < 4 << 20, f"the recording holds {held / 2**20:.0f} MiB more after 60 sessions"
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()[1:]]
    assert [line["session_id"] for line in lines] == list(range(61))


@settings(max_examples=examples(40), deadline=None)
@given(
    sessions=st.lists(st.integers(0, 9), max_size=40),
    cap=st.integers(1, 5),
)
def test_sessions_are_numbered_within_a_cap_least_recently_used_forgotten_first(
    sessions: list[int], cap: int
) -> None:
    """Against a model LRU: a remembered session keeps its number, a forgotten one seen again
    gets a new one, no number is ever given to two sessions, and at most `cap` are kept."""
    numbering = trace_recorder.Numbering(cap)
    model: dict[int, int] = {}  # insertion order = recency
    given_to: dict[int, int] = {}
    for s in sessions:
        n = numbering.number(s)
        if s in model:
            assert n == model.pop(s)
        else:
            assert n == len(given_to) and n not in given_to
        model[s] = n
        given_to[n] = s
        while len(model) > cap:
            del model[next(iter(model))]
        assert len(numbering) == len(model) <= cap


def test_the_outcome_is_recorded_without_any_text(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(MODEL, header=HEADER).start(path)
    secret = "the launch code is 0000"
    tokens = ByteCodec().encode(secret)
    run_one(FakeBackend(), rec, request("a", tokens, 5, "acme", session="user@example.com"))
    run_one(FakeBackend(eos_after=2), rec, request("b", tokens, 5, "acme", session="user@example.com"))
    rec.close()
    text = path.read_text()
    assert secret not in text and "acme" not in text and "example.com" not in text
    first, second = (json.loads(line) for line in text.splitlines()[1:])
    assert first["hash_ids"] == second["hash_ids"] == [0]
    assert first["session_id"] == second["session_id"] == 0 and first["tenant"] == second["tenant"]
    assert first["output_length"] == 5 and first["finish_reason"] == "length"
    assert second["output_length"] == 3 and second["finish_reason"] == "stop"  # two tokens, then EOS
    assert first["ttft_s"] >= 0 and first["tpot_s"] >= 0


def test_trace_stats_reads_a_recorded_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(MODEL, header=HEADER).start(path)
    shared = [7] * B
    for i, tail in enumerate([[1] * 30, [2] * 40, [1] * 30]):
        run_one(FakeBackend(), rec, request(f"r{i}", shared + tail, 2, None))
    rec.close()
    assert cli_main(["trace", "stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "requests         3" in out and "blocks           6 total, 3 distinct" in out
    # The second request hits its shared block, the third all of it: (512 + 542) / 1668.
    assert f"ideal hit        {(B + B + 30) / (3 * B + 100):.1%}" in out


def test_a_request_that_came_before_the_recording_is_not_recorded(tmp_path: Path) -> None:
    early = Generation(
        FakeBackend(), ByteCodec(), Metrics(), Job("generate", request("a", [1], 1, None)), (EOS,)
    )
    rec = TraceRecorder(MODEL).start(tmp_path / "t.jsonl")
    rec.record(early)
    assert rec.requests == 0


def test_config_header_summarises_the_first_node_and_keeps_every_one() -> None:
    node = {
        "model": "m",
        "config": {"page_size": 16, "l1_pages": 8, "l2_pages": 4, "write_policy": "write_through"},
        "layout": {
            "layers": 2,
            "kv_heads": 1,
            "head_dim": 8,
            "page_size": 16,
            "dtype": "float32",
            "page_bytes": 2048,
        },
        "storage": {"kind": "FileStore", "capacity_bytes": None, "capacity_pages": None},
    }
    got = config_header([node, None], prefill_nodes=None, router="cache_aware")
    assert got["geometry"] == {
        "layers": 2,
        "kv_heads": 1,
        "head_dim": 8,
        "dtype": "float32",
        "page_bytes": 2048,
    }
    assert (got["page_size"], got["l1_pages"], got["l2_pages"]) == (16, 8, 4)
    assert got["decode_config"]["write_policy"] == "write_through"
    assert got["nodes"] == {"decode": 2, "prefill": None, "router": "cache_aware"}
    assert got["decode_nodes"] == [node, None] and set(got["measured"].values()) == {None}
    assert got["prefill_cache_bytes"] is None  # prefill nodes the front door did not start
    alone = config_header([None], prefill_nodes=1, router=None, prefill_cache_bytes=1 << 20)
    assert alone["page_size"] is None and alone["prefill_cache_bytes"] == 1 << 20


# ============================================================================ over HTTP


@contextlib.asynccontextmanager
async def live(recorder: TraceRecorder, **kwargs: Any) -> AsyncIterator[httpx2.AsyncClient]:
    app = create_app(FakeBackend(), ByteCodec(), model_name=MODEL, recorder=recorder, **kwargs)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, app, "127.0.0.1", 0)
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=GUARD_S) as c:
            yield c
        nursery.cancel_scope.cancel()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_admins_start_and_stop_recording_into_new_files_under_the_allowed_folder(
    tmp_path: Path,
) -> None:
    rec = TraceRecorder(MODEL, directory=tmp_path / "traces", header=HEADER)
    (tmp_path / "traces").mkdir()
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 3}}
    async with live(rec, api_keys=KEYS) as c:
        r = await c.post("/start_trace_recording", json={"path": "a.jsonl"})
        assert r.status_code == 401
        r = await c.post("/start_trace_recording", json={"path": "a.jsonl"}, headers=bearer(ACME))
        assert r.status_code == 403
        assert (await c.post("/stop_trace_recording", headers=bearer(ACME))).status_code == 403
        r = await c.post("/start_trace_recording", json={"path": "a.jsonl"}, headers=bearer(ROOT))
        assert r.status_code == 200 and r.json()["recording"] is True
        assert r.json()["path"] == str((tmp_path / "traces" / "a.jsonl").resolve())
        r = await c.post("/start_trace_recording", json={"path": "b.jsonl"}, headers=bearer(ROOT))
        assert r.status_code == 409 and "already recording" in r.json()["error"]["message"]
        for _ in range(2):
            assert (await c.post("/generate", json=body, headers=bearer(ACME))).status_code == 200
        r = await c.post("/stop_trace_recording", headers=bearer(ROOT))
        assert r.json() == {"path": r.json()["path"], "recording": False, "requests": 2, "error": None}
        assert (await c.post("/generate", json=body, headers=bearer(ACME))).status_code == 200
        assert (await c.post("/stop_trace_recording", headers=bearer(ROOT))).json() == {"recording": False}
        # The same name again is refused (a start never appends); no name: a new file.
        r = await c.post("/start_trace_recording", json={"path": "a.jsonl"}, headers=bearer(ROOT))
        assert r.status_code == 409 and "exists" in r.json()["error"]["message"]
        for bad in ("../out.jsonl", "/etc/x.jsonl", "a.txt", "sub/../../x.jsonl"):
            r = await c.post("/start_trace_recording", json={"path": bad}, headers=bearer(ROOT))
            assert r.status_code == 400 and r.json()["error"]["param"] == "path", bad
        r = await c.post("/start_trace_recording", headers=bearer(ROOT))
        assert r.status_code == 200
        second = Path(r.json()["path"])
        assert second.parent == (tmp_path / "traces").resolve() and second.suffix == ".jsonl"
        assert (await c.post("/generate", json=body, headers=bearer(ROOT))).status_code == 200
        await c.post("/stop_trace_recording", headers=bearer(ROOT))
    first = read_mooncake(tmp_path / "traces" / "a.jsonl")
    assert len(first) == 2 and first[0].block_ids == first[1].block_ids
    assert len(read_mooncake(second)) == 1 and read_trace_header(second) is not None


@pytest.mark.parametrize("bad", ["a\x00.jsonl", "\x00", "sub/\x00/x.jsonl", "x" * 5000 + ".jsonl"])
async def test_a_path_the_os_cannot_take_is_a_400_naming_the_field(tmp_path: Path, bad: str) -> None:
    """Issue 30, finding 10: a NUL byte in the path answered 500 with a traceback."""
    rec = TraceRecorder(MODEL, directory=tmp_path, header=HEADER)
    async with live(rec) as c:
        r = await c.post("/start_trace_recording", json={"path": bad})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "path" and "path" in error["message"], error
        assert rec.active is None and list(tmp_path.iterdir()) == []


async def test_without_an_allowed_folder_recording_cannot_start() -> None:
    async with live(TraceRecorder(MODEL)) as c:
        r = await c.post("/start_trace_recording", json={"path": "a.jsonl"})
        assert r.status_code == 400 and "--record-trace-dir" in r.json()["error"]["message"]


class FillsUp(io.RawIOBase):
    """A file with room for `room` bytes, then ENOSPC: a disk that fills up while recording."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        """As a disk does: what fits, then an error for the rest."""
        fits = bytes(b)[: self.room - len(self.data)]
        if not fits:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.data += fits
        return len(fits)

    def truncate(self, size: int | None = None) -> int:
        del self.data[size:]
        return len(self.data)


async def test_a_write_error_stops_recording_and_requests_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = FillsUp(room=2000)
    monkeypatch.setattr(trace_recorder, "open_trace", lambda path: disk)
    rec = TraceRecorder(MODEL, directory=tmp_path, header=HEADER)
    body = {"text": "x" * 200, "sampling_params": {"max_new_tokens": 2}}
    async with live(rec) as c:
        assert (await c.post("/start_trace_recording", json={"path": "t.jsonl"})).status_code == 200
        for _ in range(40):
            assert (await c.post("/generate", json=body)).status_code == 200
        assert rec.active is None and rec.current is not None
        assert "No space left" in (rec.current.error or "")
        # The error was at a line's end: every line written before it is whole.
        lines = bytes(disk.data).decode().splitlines()
        assert 1 < len(lines) < 40 and all(json.loads(line) for line in lines)
        r = await c.post("/stop_trace_recording")
        assert r.json()["requests"] == len(lines) - 1 and "No space left" in r.json()["error"]


def test_a_read_only_folder_refuses_the_start_with_its_reason(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders (the tmpfs test below covers root)")
        with pytest.raises(trace_recorder.RecordingError, match="cannot create the trace"):
            TraceRecorder(MODEL, directory=folder).start(folder / "t.jsonl")
    finally:
        folder.chmod(0o700)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Any:
    """A 16 KiB tmpfs (root only): a disk that really fills up."""
    where = tmp_path / "small"
    where.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(where)], capture_output=True
    )
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_a_full_disk_stops_recording_and_no_request_fails(small_tmpfs: Path) -> None:
    rec = TraceRecorder(MODEL, directory=small_tmpfs, header=HEADER).start(small_tmpfs / "t.jsonl")
    backend = FakeBackend()
    for i in range(400):
        gen = run_one(backend, rec, request(f"r{i}", [i % 250 + 1] * 600, 1, None))
        assert gen.finish is not None and gen.finish.reason == "length"
        if not rec.active:
            break
    assert not rec.active and "No space left" in (rec.error or "")
    assert 0 < rec.requests < 400
    assert len(read_mooncake(small_tmpfs / "t.jsonl")) == rec.requests


# ============================================================================ end to end


@pytest.mark.process
@pytest.mark.real_model
def test_hicache_serve_records_what_it_serves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real `hicache serve` (default model), three chat requests, two sharing a system prompt
    over one 512-token block: the trace shows the shared block, and its header the node."""
    import openai

    trace = tmp_path / "served.jsonl"
    args = ["--page-size", "16", "--record-trace", str(trace), "--log-dir", str(tmp_path / "logs")]
    args += ["--record-block-size", str(B)]  # Mooncake's blocks, the per-page ids alongside
    with running(*args, command=("serve",), logs=tmp_path, timeout=600, stop_s=60) as proc:
        url = proc.info["url"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        system = "Answer briefly. " + " ".join(f"rule {i}: be kind." for i in range(120))
        for question in ("What is 2 + 2?", "Name a colour.", "What is 2 + 2?"):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            client.chat.completions.create(model=MODEL_SERVED, messages=messages, max_tokens=2, temperature=0)
    got = read_mooncake(trace)
    assert len(got) == 3 and all(r.input_length > B and r.output_length >= 1 for r in got)
    first, second, third = (r.block_ids or () for r in got)
    assert first[0] == second[0] and first[1:] != second[1:] and third == first
    header = read_trace_header(trace)
    assert header is not None and header["page_size"] == 16 and header["decode_config"]["page_size"] == 16
    assert header["geometry"]["layers"] > 0 and header["nodes"]["decode"] == 1
    assert header["prefill_cache_bytes"] == 512 << 20  # it started the prefill node, at the default
    assert header["block_size"] == B and header["page_block_size"] == 16
    pages = [json.loads(line)["page_hash_ids"] for line in trace.read_text().splitlines()[1:]]
    shared = next(i for i, (x, y) in enumerate(zip(pages[0], pages[1], strict=False)) if x != y)
    assert shared * 16 > B and pages[2] == pages[0]  # the system prompt's pages past the first block
    assert cli_main(["trace", "stats", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "blocks           6 total, 3 distinct" in out and "ideal hit        0.0%" not in out


async def test_a_decode_node_says_what_it_runs_with(tmp_path: Path) -> None:
    from node_pair import node_pair, small_core

    async with node_pair(tmp_path, config={"write_policy": "write_back"}) as pair:
        got = await pair.client.config()
    want = attrs.asdict(attrs.evolve(small_core(), write_policy="write_back"))
    assert got["config"] == {k: getattr(v, "value", v) for k, v in want.items()}
    assert got["config"]["write_policy"] == "write_back"  # the enum's value, as JSON carries it
    layout = pair.service.layout
    assert got["layout"]["page_bytes"] == layout.page_bytes and got["layout"]["layers"] == layout.layers
    assert got["storage"]["kind"] == "FileStore" and got["model"] == pair.service.model_name
    assert config_header([got], prefill_nodes=1, router=None)["page_size"] == small_core().page_size
