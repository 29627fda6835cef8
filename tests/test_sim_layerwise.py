"""Layer-wise P->D streaming and the per-transfer rate ceiling in the simulator.

The closed form a streamed transfer uses equals a queue of its layer groups sent one by one; a
transfer that finds prefill over is an ordinary reservation; streaming never lands before
prefill ends nor before the bytes could cross; lanes keep each transfer under its ceiling and
all of them under the link; and the switch that turns streaming off gives the driver of before.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.core import commands as cmd
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import Scenario, ScenarioError, parse_scenario
from hicache.scenarios.workload import WorkItem
from hicache.sim import cluster as cluster_module
from hicache.sim.channel import MAX_LANES, Channel, gapless_start, lanes_for, streamed_end
from hicache.sim.cluster import Cluster, RunResult
from hicache.sim.decode import DecodeDriver
from hicache.sim.setup import setups

times = st.floats(0.0, 1e3, allow_nan=False)
spans = st.floats(1e-6, 1e2, allow_nan=False)
wires = st.floats(0.0, 1e2, allow_nan=False)
groups = st.integers(1, 200)
shares = st.one_of(st.just(1.0), st.floats(0.0, 1.0, allow_nan=False))


def queue_of_groups(
    s0: float, ps: float, pe: float, g: int, head: float, body: float, share: float = 1.0
) -> float:
    """The streamed transfer sent item by item: the head at ps, then group k at its ready time,
    each starting when the link is free and its data exists; only `share` of the wire is sent
    (a tail under 1e-9 of a group waits for nothing, as in the closed form)."""
    b = body / g
    items = [(ps, head)] + [(ps + (k + 1) * (pe - ps) / g, b) for k in range(g)]
    left = (head + body) * share
    t = max(s0, ps)  # nothing exists before ps
    for i, (ready, wire) in enumerate(items):
        w = min(wire, left)
        left -= w
        if w <= 0:
            continue
        t = t + w if i > 0 and w < 1e-9 * b else max(t, ready) + w
    return max(t, pe) if share >= 1.0 else t  # whole, it completes with prefill


@given(s0=times, ps=times, span=spans, g=groups, head=wires, body=wires, share=shares)
def test_the_closed_form_is_the_queue_of_groups(
    s0: float, ps: float, span: float, g: int, head: float, body: float, share: float
) -> None:
    pe = ps + span
    got = streamed_end(s0, ps, pe, g, head, body, share)
    want = queue_of_groups(s0, ps, pe, g, head, body, share)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-9)


@given(s0=times, ps=times, span=spans, g=groups, rate=st.floats(1e6, 1e11), nbytes=st.floats(0, 1e10))
def test_the_brief_closed_form_with_no_head(
    s0: float, ps: float, span: float, g: int, rate: float, nbytes: float
) -> None:
    """Last group lands at max(max(s0, a_0) + G b, max(s0, a_{G-1}) + b)."""
    pe = ps + span
    b = nbytes / (g * rate)
    a = [ps + (k + 1) * span / g for k in range(g)]
    want = max(max(s0, a[0]) + g * b, max(s0, a[-1]) + b)
    assert streamed_end(s0, ps, pe, g, 0.0, nbytes / rate) == pytest.approx(want, rel=1e-12, abs=1e-12)


@given(
    now=times,
    free=times,
    back=st.floats(0.0, 1e3),
    span=spans,
    g=groups,
    head=st.floats(0, 1e10),
    body=st.floats(0, 1e10),
)
def test_a_transfer_after_prefill_ended_is_a_plain_reservation(
    now: float, free: float, back: float, span: float, g: int, head: float, body: float
) -> None:
    pe = now - back
    ps = pe - span
    streamed, plain = Channel("s", 1e9, 1e-3), Channel("p", 1e9, 1e-3)
    streamed.free_at = plain.free_at = free
    t = streamed.stream(now, head, body, ps, pe, g)
    u = plain.reserve(now, head + body)
    assert t.start == u.start
    assert t.done == pytest.approx(u.done, rel=1e-12, abs=1e-12)
    assert streamed.free_at == pytest.approx(plain.free_at, rel=1e-12, abs=1e-12)


@given(
    now=times,
    free=times,
    ps_after=st.floats(0, 1e2),
    span=spans,
    g=groups,
    head=st.floats(0, 1e10),
    body=st.floats(1, 1e10),
    rate=st.floats(1e6, 1e11),
)
def test_streaming_lands_after_prefill_and_after_the_wire_time(
    now: float, free: float, ps_after: float, span: float, g: int, head: float, body: float, rate: float
) -> None:
    ps = now + ps_after
    pe = ps + span
    ch = Channel("net", rate, 0.0)
    ch.free_at = free
    t = ch.stream(now, head, body, ps, pe, g)
    wire = (head + body) / rate
    eps = 1e-12 * max(1.0, free, pe + wire)  # rounding of times this large
    assert t.busy_until >= pe  # the last group exists only when prefill ends
    assert t.busy_until >= t.start + wire - eps  # nor faster than the link
    assert t.busy_until >= pe + body / (g * rate) - eps  # and the last group still crosses
    # never later than waiting for prefill to end, as the transfer did before streaming
    assert t.busy_until <= max(now, free, pe) + wire + eps
    assert t.done == t.busy_until


@given(
    bandwidth=st.floats(1e8, 1e11),
    ceiling=st.floats(1e7, 2e11),
    ops=st.lists(
        st.tuples(st.floats(0, 1.0), st.floats(0, 1e9), st.booleans(), st.floats(0, 0.5)),
        min_size=1,
        max_size=40,
    ),
)
def test_lanes_keep_each_transfer_under_its_ceiling_and_all_under_the_link(
    bandwidth: float, ceiling: float, ops: list[tuple[float, float, bool, float]]
) -> None:
    lanes = lanes_for(bandwidth, ceiling)
    ch = Channel("net", bandwidth, 1e-6, lanes=lanes)
    assert ch.lane_rate <= min(ceiling, bandwidth) * (1 + 1e-12)
    assert ch.lane_rate * ch.lanes == pytest.approx(bandwidth)
    now = 0.0
    held: list[tuple[float, float]] = []  # each transfer's [start, end) of moving data
    last_end = [0.0] * lanes
    total = 0.0
    for gap, nbytes, streamed, span in ops:
        now += gap
        free = ch.free_at
        if streamed:
            t = ch.stream(now, nbytes / 3, nbytes * 2 / 3, now + span / 2, now + span, 16)
        else:
            t = ch.reserve(now, nbytes)
        assert t.start >= max(now, free)  # no lane frees earlier than the first one free
        assert t.start >= last_end[t.lane]  # a lane is a FIFO: one transfer at a time
        last_end[t.lane] = t.busy_until
        # at most the lane's rate, which is at most the ceiling (to the rounding of times)
        assert t.busy_until >= t.start + nbytes / ch.lane_rate - 1e-12 * max(1.0, t.busy_until)
        held.append((t.start, t.busy_until))
        total += nbytes
    # at no instant do more transfers move than there are lanes: together at most the link
    for at, _ in held:
        assert sum(1 for a, b in held if a <= at < b) <= lanes
    assert ch.bytes_moved == pytest.approx(total)
    assert ch.busy_time == pytest.approx(total / bandwidth)
    assert ch.transfers == len(ops)
    end = max(b for _, b in held)
    if end > 0:
        assert ch.busy_time / end <= 1 + 1e-9  # utilisation of the whole link


def test_one_lane_is_the_plain_fifo() -> None:
    assert lanes_for(25e9, None) == 1
    assert lanes_for(25e9, 30e9) == 1
    assert lanes_for(200e9, 0.6e9) == 334
    a, b = Channel("a", 1e9, 0.01), Channel("b", 1e9, 0.01, lanes=lanes_for(1e9, 1e9))
    for now, nbytes in ((0.0, 1e9), (0.5, 0.5e9), (3.0, 1.0)):
        ta, tb = a.reserve(now, nbytes), b.reserve(now, nbytes)
        assert (ta.start, ta.busy_until, ta.done) == (tb.start, tb.busy_until, tb.done)
    assert (a.free_at, a.busy_time, a.bytes_moved) == (b.free_at, b.busy_time, b.bytes_moved)


def test_a_ceiling_runs_transfers_side_by_side() -> None:
    ch = Channel("net", 2e9, 0.0, lanes=lanes_for(2e9, 1e9))
    t1, t2, t3 = (ch.reserve(0.0, 1e9) for _ in range(3))
    assert (t1.start, t1.busy_until) == (0.0, 1.0)  # 1 GB/s each, not the link's 2 GB/s
    assert (t2.start, t2.busy_until) == (0.0, 1.0)  # alongside the first
    assert (t3.start, t3.busy_until) == (1.0, 2.0)  # both lanes busy: it queues
    assert ch.busy_time == pytest.approx(1.5)  # 3 GB at 2 GB/s
    ch.cut(t3, 1.5)
    assert ch.busy_time == pytest.approx(1.25) and ch.bytes_moved == pytest.approx(2.5e9)


def test_a_ceiling_too_small_for_the_link_names_its_field() -> None:
    s = scenario(hardware={"transfer_rate": 1.0})
    with pytest.raises(ScenarioError) as info:
        setups(s)
    assert info.value.field == "hardware.transfer_rate"
    assert str(MAX_LANES) in info.value.detail


# --------------------------------------------------------------------------- the cluster


def scenario(**sections: dict[str, Any]) -> Scenario:
    doc: dict[str, Any] = {
        "workload": {
            "kind": "multiturn",
            "conversations": 1,
            "turns": 1,
            "system_prompt": 0,
            "user_tokens": [8192, 8192],
            "output_tokens": [4, 4],
        },
        "run": {"baselines": ["no_decode_cache"]},
    }
    for name, values in sections.items():
        doc[name] = {**doc.get(name, {}), **values}
    return parse_scenario(doc, "test.toml")


def one_request(layerwise: bool, **hardware: Any) -> tuple[float, float, float]:
    """TTFT of a lone 8K prompt, its prefill compute time and its transfer's wire time."""
    s = scenario(hardware=hardware, cluster={"layerwise_transfer": layerwise})
    setup = setups(s)["no_decode_cache"]
    result = Cluster(setup).run(build(s))
    (r,) = result.records
    prefill = setup.costs.prefill_seconds(r.prompt_tokens, 0)
    return r.ttft_s, prefill, r.pd_transfer_bytes / setup.network_bandwidth


def build(s: Scenario) -> list[WorkItem]:
    return build_workload(s)


TICK = 0.002  # the scenario's tick_interval: the core notices an arrival at its next tick


def test_on_a_slow_link_streaming_saves_the_prefill_time() -> None:
    on, prefill, wire = one_request(True, network_bandwidth=1e7)
    off, _, _ = one_request(False, network_bandwidth=1e7)
    assert wire > 10 * prefill  # the link, not prefill, decides
    assert off - on == pytest.approx(prefill, abs=2 * TICK)
    assert off - on <= prefill + 2 * TICK


def test_on_a_fast_link_streaming_ends_one_group_after_prefill() -> None:
    layers = 64  # qwen2.5-32b
    on, prefill, wire = one_request(True, network_bandwidth=50e9)
    off, _, _ = one_request(False, network_bandwidth=50e9)
    assert wire < prefill  # each group crosses before the next exists
    assert 0 <= off - on <= wire + 2 * TICK
    # sent after prefill it lands a whole transfer after prefill's end, streamed one group after
    assert on - (off - wire) == pytest.approx(wire / layers, abs=2 * TICK)


def test_a_prefill_cache_hit_goes_out_first_and_the_rest_streams() -> None:
    """A second turn whose earlier prompt prefill holds: that part leaves once prefill's restore
    is done, the new tokens as they are computed; the transfer lands no later than without
    streaming, and not before prefill ends."""
    workload = {"turns": 2, "think_time": 0.5, "arrivals": "closed", "output_tokens": [64, 64]}
    ttft = {}
    for layerwise in (True, False):
        s = scenario(workload=workload, cluster={"layerwise_transfer": layerwise})
        records = Cluster(setups(s)["no_decode_cache"]).run(build(s)).records
        assert [r.outcome for r in records] == ["finished", "finished"]
        assert records[1].prefill_cached_tokens > 0
        ttft[layerwise] = [r.ttft_s for r in records]
    assert all(a <= b + 1e-9 for a, b in zip(ttft[True], ttft[False], strict=True))


class _BeforeStreaming(DecodeDriver):
    """The driver's P->D transfer as it was before streaming: sent once prefill has ended, on
    one FIFO."""

    def _request_kv(self, c: cmd.RequestKV) -> None:
        live = self.live[c.req]
        if live.promised_tokens < 0:
            live.promised_tokens = c.start
        if self.faults is not None:
            self.faults.issue_transfer(c)
        live.prefill.when_done(c.req, lambda: self._send_whole(c))

    def _send_whole(self, c: cmd.RequestKV) -> None:
        live = self.live.get(c.req)
        nbytes = (c.end - c.start) * self.kvb
        fault = self.faults.transfer(c) if self.faults is not None else None
        if fault is not None:
            nbytes *= fault.share
        if live is not None:
            live.pd_bytes += nbytes
        t = self.network.reserve(self.loop.now, nbytes)
        if fault is not None and fault.fail:
            self.loop.call_at(t.done + fault.delay, self._failed, c.req, c.transfer, fault.reason)
            return
        delay = fault.delay if fault is not None else 0.0
        self.loop.call_at(t.done + delay, self._arrived, c.req, c.transfer)


def _run(s: Scenario, baseline: str) -> RunResult:
    return Cluster(setups(s)[baseline]).run(build(s))


@pytest.mark.parametrize("faulty", [False, True], ids=["clean", "transfer-faults"])
def test_streaming_off_is_the_driver_before_streaming(monkeypatch: pytest.MonkeyPatch, faulty: bool) -> None:
    sections: dict[str, Any] = {
        "workload": {
            "conversations": 12,
            "turns": 3,
            "rate": 2.0,
            "think_time": 1.0,
            "user_tokens": [500, 4000],
        },
        "hardware": {"network_bandwidth": 0.2e9},
        "cluster": {"layerwise_transfer": False},
        "run": {"baselines": ["no_decode_cache", "l1_l2_l3"]},
    }
    if faulty:
        sections["faults"] = {"seed": 3, "transfer": [{"kind": "partial", "rate": 0.2}]}
    s = scenario(**sections)
    for baseline in ("no_decode_cache", "l1_l2_l3"):
        off = _run(s, baseline)
        with monkeypatch.context() as m:
            m.setattr(cluster_module, "DecodeDriver", _BeforeStreaming)
            before = _run(s, baseline)
        assert [repr(attrs.astuple(r)) for r in off.records] == [
            repr(attrs.astuple(r)) for r in before.records
        ]
        wall = {"wall_s", "events_per_s"}  # the host's time, not the simulation's
        assert repr({k: v for k, v in off.summary.items() if k not in wall}) == repr(
            {k: v for k, v in before.summary.items() if k not in wall}
        )
        assert off.channels == before.channels


@pytest.mark.parametrize("faulty", [False, True], ids=["clean", "transfer-faults"])
def test_streaming_with_a_ceiling_ends_every_request(faulty: bool) -> None:
    sections: dict[str, Any] = {
        "workload": {
            "conversations": 12,
            "turns": 3,
            "rate": 2.0,
            "think_time": 1.0,
            "user_tokens": [500, 4000],
        },
        "hardware": {"network_bandwidth": 2e9, "transfer_rate": 0.5e9},
        "run": {"baselines": ["no_decode_cache", "l1_l2_l3"]},
    }
    if faulty:
        sections["faults"] = {
            "seed": 1,
            "transfer": [
                {"kind": "partial", "rate": 0.1},
                {"kind": "error", "rate": 0.05},
                {"kind": "delay", "rate": 0.1, "seconds": [0.01, 0.2]},
            ],
        }
    s = scenario(**sections)
    for baseline in ("no_decode_cache", "l1_l2_l3"):
        result = _run(s, baseline)
        assert len(result.records) == 36
        for r in result.records:
            assert r.outcome == "finished" or (faulty and r.reason), r
        net = result.channels["D0.net"]
        assert 0 < net["utilization"] <= 1
        assert net["bytes"] == pytest.approx(sum(r.pd_transfer_bytes for r in result.records))
        if faulty:
            assert result.summary["faults_injected"]


def test_groups_default_to_the_layers_and_can_be_set() -> None:
    s = scenario()
    setup = setups(s)["no_decode_cache"]
    assert Cluster(setup).decode[0].layer_groups == setup.costs.model.layers
    s = scenario(cluster={"transfer_groups": 4})
    assert Cluster(setups(s)["no_decode_cache"]).decode[0].layer_groups == 4
    s = scenario(cluster={"layerwise_transfer": False, "transfer_groups": 4})
    assert Cluster(setups(s)["no_decode_cache"]).decode[0].layer_groups == 0
    s = scenario(hardware={"network_bandwidth": 25e9, "transfer_rate": 0.6e9})
    net = Cluster(setups(s)["no_decode_cache"]).decode[0].network
    assert net.lanes == math.ceil(8 * 25e9 / 0.6e9) and net.lane_rate <= 0.6e9


@given(s0=times, ps=times, span=spans, g=groups, head=wires, body=st.floats(1e-6, 1e2))
def test_a_stream_booked_at_its_gapless_start_ends_as_the_closed_form(
    s0: float, ps: float, span: float, g: int, head: float, body: float
) -> None:
    """Booked later, at the last moment it can go out in one stretch, a streamed transfer lands
    when the closed form says for a link free from any earlier time: the link was the others'
    meanwhile at no cost to it."""
    pe = ps + span
    at = gapless_start(ps, pe, g, head, body)
    assert at >= ps
    eps = 1e-12 * max(1.0, s0, pe + head + body)
    early = streamed_end(min(s0, at), ps, pe, g, head, body)
    assert at + head + body == pytest.approx(early, rel=1e-9, abs=1e-9)
    assert streamed_end(at, ps, pe, g, head, body) == pytest.approx(early, rel=1e-9, abs=1e-9)
    assert early >= at + head + body - eps


def test_a_long_prefill_does_not_hold_the_link_from_a_short_one() -> None:
    """A 60K prompt streams from one prefill node while a 2K prompt, sent just after it, is
    computed on the other: the short one's KV crosses first, as without streaming."""
    items = [WorkItem("long", 0.0, 60_000, 4), WorkItem("short", 0.01, 2_000, 4)]
    ttft = {}
    for layerwise in (True, False):
        s = scenario(
            cluster={"prefill_nodes": 2, "layerwise_transfer": layerwise},
            hardware={"network_bandwidth": 1e9},
        )
        records = Cluster(setups(s)["no_decode_cache"]).run(items).records
        ttft[layerwise] = {r.id: r.ttft_s for r in records}
    assert ttft[True]["short"] <= ttft[False]["short"] + 2 * TICK
    assert ttft[True]["long"] <= ttft[False]["long"]
    assert ttft[True]["short"] < ttft[True]["long"] / 4
