"""What a recording carries for the digital twin beyond the Mooncake fields, and what the twin
makes of it (runtime/serving/trace_recorder.py, sim/twin_clients.py, sim/twin_tiers.py): per-page
ids beside coarser blocks, so a prompt shorter than a block keeps the prefix it shares; the
arrival process (requests in flight, the previous turn's end), from which the clients and their
think times are inferred; a recording coarser than the node's pages refused unless approximated;
and every request whose tiers the replay did not predict named with its reason.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import trio
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_fakes import EOS, ByteCodec, FakeBackend
from test_twin import sim_scenario, write_recording

from hicache.cli import main as cli_main
from hicache.results import RequestRecord
from hicache.runtime.serving.backend import GenerateRequest, Sampling
from hicache.runtime.serving.generation import Generation, Job
from hicache.runtime.serving.metrics import Metrics
from hicache.runtime.serving.trace_recorder import TraceRecorder
from hicache.scenarios.traces import read_mooncake
from hicache.sim import twin
from hicache.sim.twin_recording import Recorded, Recording, TwinError
from hicache.sim.twin_tiers import REASONS, tier_differences

MODEL = "fake-echo"
PAGE = 16


def gen_for(req: GenerateRequest, on_end: object) -> Generation:
    return Generation(FakeBackend(), ByteCodec(), Metrics(), Job("generate", req), (EOS,), on_end=on_end)  # type: ignore[arg-type]


def drain(gen: Generation) -> None:
    async def go() -> None:
        async for _ in gen.run():
            pass

    trio.run(go)


def req(rid: str, tokens: list[int], session: str = "") -> GenerateRequest:
    return GenerateRequest(rid, tokens, 2, Sampling(), None, session)


# ============================================================================ the recorder


def test_blocks_default_to_the_page_and_short_prompts_keep_their_shared_prefix(tmp_path: Path) -> None:
    """Three chats of 200-300 tokens sharing a 160-token system prompt: at the page size (the
    default) their ids share the prefix; at Mooncake's 512 each is one fresh id, and the per-page
    ids alongside still share it."""
    system = list(range(100, 260))
    prompts = [system + [7 + c] * (40 + 50 * c) for c in range(3)]
    for block, name in ((None, "page.jsonl"), (512, "coarse.jsonl")):
        recorder = TraceRecorder(MODEL, header={"page_size": PAGE}, block_size=block, page_size=PAGE)
        rec = recorder.start(tmp_path / name)
        for i, p in enumerate(prompts):
            gen = gen_for(req(f"r{i}", p, f"c{i}"), rec.record)
            drain(gen)
        rec.close()
    page = [json.loads(x) for x in (tmp_path / "page.jsonl").read_text().splitlines()]
    assert page[0]["block_size"] == PAGE and "page_block_size" not in page[0]
    ids = [line["hash_ids"] for line in page[1:]]
    assert ids[0][:10] == ids[1][:10] == ids[2][:10] and len({i[10] for i in ids}) == 3
    coarse = [json.loads(x) for x in (tmp_path / "coarse.jsonl").read_text().splitlines()]
    assert coarse[0]["block_size"] == 512 and coarse[0]["page_block_size"] == PAGE
    assert [line["hash_ids"] for line in coarse[1:]] == [[0], [1], [2]]  # the prefix hidden
    pages = [line["page_hash_ids"] for line in coarse[1:]]
    assert pages[0][:10] == pages[1][:10] == pages[2][:10]
    assert [len(p) for p in pages] == [math.ceil(len(p) / PAGE) for p in prompts]
    assert len(read_mooncake(tmp_path / "coarse.jsonl")) == 3  # still a Mooncake trace


def test_each_line_carries_the_requests_in_flight_and_the_previous_turn_s_end(tmp_path: Path) -> None:
    rec = TraceRecorder(MODEL, header={"page_size": PAGE}, page_size=PAGE).start(tmp_path / "t.jsonl")
    a, b = gen_for(req("a", [1] * 20, "s1"), rec.record), gen_for(req("b", [2] * 20, "s2"), rec.record)
    rec.arrived(a)
    rec.arrived(b)  # b arrives while a is in flight
    drain(a)
    c = gen_for(req("c", [1] * 30, "s1"), rec.record)  # a's next turn, once a ended; b still in flight
    rec.arrived(c)
    drain(b)
    drain(c)
    rec.close()
    la, lb, lc = map(json.loads, (tmp_path / "t.jsonl").read_text().splitlines()[1:])  # as they ended
    assert [x["input_length"] for x in (la, lb, lc)] == [20, 20, 30]
    assert (la["in_flight"], lb["in_flight"], lc["in_flight"]) == (0, 1, 1)
    assert "previous_finished" not in la and "previous_finished" not in lb
    assert lc["previous_finished"] == la["finished"] <= lc["timestamp"]
    assert all(line["timestamp"] <= line["finished"] for line in (la, lb, lc))


# ============================================================================ the twin


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("arrivals") / "sim.jsonl"
    write_recording(path, sim_scenario())
    return path


def test_a_recording_coarser_than_the_page_is_refused_in_one_line_unless_approximated(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = recorded.read_text().splitlines()
    head = json.loads(lines[0])
    head["block_size"] = 2 * PAGE
    out = [json.dumps(head)]
    for raw in lines[1:]:
        line = json.loads(raw)
        line["hash_ids"] = line["hash_ids"][::2]  # one id per two pages: ceil(n / 32) of them
        out.append(json.dumps(line))
    coarse = tmp_path / "coarse.jsonl"
    coarse.write_text("\n".join(out) + "\n")
    with pytest.raises(TwinError, match=rf"^{coarse}: recorded at 32 tokens per hash id.*page size 16"):
        twin.twin(coarse)
    assert cli_main(["sim", "twin", str(coarse)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(coarse) in err[0] and "32" in err[0] and "16" in err[0]
    res = twin.twin(coarse, approximate=True)
    assert res.predicted["requests"] > 0


def recording(rows: list[tuple[str, float, float]]) -> Recording:
    """(session, arrival, end) rows as a recording: the previous turn's end on each line."""
    out, last = [], {}
    for i, (s, a, e) in enumerate(sorted(rows, key=lambda r: r[1])):
        out.append(
            Recorded(
                f"r{i}",
                i,
                a,
                32,
                2,
                (0, i + 1),
                s,
                (0, 0, 0),
                None,
                None,
                0.01,
                0.01,
                "length",
                finished=e,
                previous_finished=last.get(s),
            )
        )
        last[s] = e
    return Recording(Path("mem.jsonl"), {}, PAGE, tuple(out))


@settings(max_examples=examples(50), deadline=None)
@given(
    clients=st.integers(1, 4),
    sessions=st.lists(
        st.lists(st.tuples(st.floats(0.05, 2.0), st.floats(0.0, 1.0)), min_size=1, max_size=4),
        min_size=4,
        max_size=10,
    ),
)
def test_the_clients_and_their_think_times_are_inferred(
    clients: int, sessions: list[list[tuple[float, float]]]
) -> None:
    """`clients` workers take sessions from a queue and send each one's turns one after another
    (service time, then think time): the twin infers that many clients and each pause."""
    free = [0.0] * clients
    rows, pauses = [], []
    for s, turns in enumerate(sessions):
        w = min(range(clients), key=free.__getitem__)
        t = free[w]
        for k, (service, think) in enumerate(turns):
            if k:
                t += think
                pauses.append(think)
            rows.append((f"s{s}", t, t + service))
            t += service
        free[w] = t + 0.001  # the worker takes its next session a moment later
    got = twin.infer_clients(recording(rows))
    assert got.count == (0 if clients == 1 else clients)  # one client: one request at a time
    assert got.peak_sessions == clients
    if pauses:
        assert got.think_max_s == pytest.approx(max(pauses), abs=1e-6)


def record(rid: str, tiers: tuple[int, int, int], arrival: float = 0.0, e2e: float = 0.1) -> RequestRecord:
    return RequestRecord(
        rid, "", 0, arrival, 0, 0, 64, 2, "finished", "", 0.05, 0.01, e2e, *tiers, 0, 0, 0, 0, 0.0, 0
    )


def test_every_differing_request_is_named_with_its_reason() -> None:
    rows = [  # id, arrival, block ids, session, measured tiers, end, finish reason
        ("a", 0.0, (1, 2, 3, 4), "s1", (0, 0, 0), 1.0, "length"),
        ("b", 0.5, (1, 2, 3, 5), "s2", (32, 0, 0), 1.5, "length"),
        ("c", 2.0, (1, 2, 3, 4), "s1", (48, 0, 0), 2.5, "length"),
        ("d", 3.0, (9, 8, 7, 6), "s3", (0, 16, 0), 3.5, "length"),
        ("e", 4.0, (9, 8, 7, 5), "s4", (0, 0, 0), 4.1, "abort"),
        ("f", 5.0, (9, 8, 7, 6), "s3", (48, 0, 0), 5.5, "length"),
    ]
    lines = tuple(
        Recorded(rid, i, t, 64, 2, ids, s, m, None, None, 0.1, 0.01, why, finished=end)
        for i, (rid, t, ids, s, m, end, why) in enumerate(rows)
    )
    rec = Recording(Path("mem.jsonl"), {}, PAGE, lines)
    predicted = {
        "a": record("a", (0, 0, 0), 0.0, 1.0),
        "b": record("b", (16, 0, 0), 0.5),  # a (sharing 48 tokens) was in flight: a race
        "c": record("c", (16, 32, 0), 2.0),  # the same 48 tokens, in other tiers
        "d": record("d", (32, 0, 0), 3.0),  # more than the node found
        "e": record("e", (16, 0, 0), 4.0),  # the client left on the node
        "f": record("f", (16, 0, 0), 5.0),  # its session's turn d differed
    }
    got = {x.id: x.reason for x in tier_differences(rec, predicted)}
    assert got == {
        "b": "race",
        "c": "tier placement",
        "d": "evicted on the node",
        "e": "abandoned",
        "f": "after a differing turn",
    }
    assert set(got.values()) <= set(REASONS)
    predicted["c"] = record("c", (16, 0, 0), 2.0)
    predicted.pop("f")
    got = {x.id: x.reason for x in tier_differences(rec, predicted)}
    assert got["c"] == "evicted in the replay" and got["f"] == "not replayed"
