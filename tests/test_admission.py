"""The front door's admission (runtime/serving/admission.py): a bounded queue in front of the
decode nodes. The slot bookkeeping is property-tested as a state machine; the trio driver and
the app are driven by real HTTP clients on a loopback port, with the fake backend of
tests/serving_fakes.py held open so that the queue fills: a full queue answers 503 with
Retry-After at once, and the queue's gauges and wait histogram move."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import attrs
import httpx2
import pytest
import trio
import trio.testing
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prometheus_client.parser import text_string_to_metric_families
from serving_fakes import ByteCodec, FakeBackend

from hicache.runtime.serving import create_app, serve_http
from hicache.runtime.serving.admission import Admission, Overloaded, Slots
from hicache.runtime.serving.backend import GenerateEvent, GenerateRequest
from hicache.runtime.serving.health import Health

GUARD_S = 20  # a guard against hangs, never a speed assertion


# ============================================================================ the bookkeeping


class SlotsMachine(RuleBasedStateMachine):
    """`Slots` against a plain model: FIFO, never more running, queued or tokens held than
    allowed (a request alone always fits), and a freed slot goes to the oldest waiters that fit."""

    @initialize(running=st.integers(1, 4), queued=st.integers(0, 4), budget=st.sampled_from([0, 10, 25]))
    def start(self, running: int, queued: int, budget: int) -> None:
        self.slots = Slots(running, queued, budget)
        self.next = 0
        self.model_running: dict[int, int] = {}
        self.model_queue: list[tuple[int, int]] = []

    def _fits(self, need: int) -> bool:
        s = self.slots
        if len(self.model_running) >= s.max_running:
            return False
        held = sum(self.model_running.values())
        return not s.max_tokens or not self.model_running or held + need <= s.max_tokens

    def _start_heads(self) -> list[int]:
        started = []
        while self.model_queue and self._fits(self.model_queue[0][1]):
            ticket, need = self.model_queue.pop(0)
            self.model_running[ticket] = need
            started.append(ticket)
        return started

    @rule(need=st.integers(0, 30))
    def arrive(self, need: int) -> None:
        ticket, self.next = self.next, self.next + 1
        got = self.slots.arrive(ticket, need)
        if not self.model_queue and self._fits(need):
            assert got == "run"
            self.model_running[ticket] = need
        elif len(self.model_queue) < self.slots.max_queued:
            assert got == "queued"
            self.model_queue.append((ticket, need))
        else:
            assert got == "refused"

    @precondition(lambda self: self.model_running)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(sorted(self.model_running)))
        del self.model_running[ticket]
        assert self.slots.leave(ticket) == self._start_heads()  # the oldest waiters that fit, in order

    @precondition(lambda self: self.model_queue)
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        ticket, need = data.draw(st.sampled_from(self.model_queue))
        was_head = self.model_queue[0][0] == ticket
        self.model_queue.remove((ticket, need))
        expected = self._start_heads() if was_head else []
        assert self.slots.withdraw(ticket) == expected
        assert self.slots.withdraw(ticket) is None  # a second time: it is not queued any more

    @invariant()
    def bounded_and_consistent(self) -> None:
        if not hasattr(self, "slots"):
            return
        s = self.slots
        assert s.held == self.model_running and s.running == len(self.model_running) <= s.max_running
        assert s.tokens == sum(self.model_running.values())
        assert not s.max_tokens or s.running <= 1 or s.tokens <= s.max_tokens
        assert list(s.queue) == self.model_queue and len(s.queue) <= s.max_queued
        assert not s.queue or not s.fits(s.queue[0][1])  # the head waits only while it does not fit


TestSlots = SlotsMachine.TestCase


def test_slots_refuse_impossible_limits_and_a_leave_without_a_run() -> None:
    with pytest.raises(ValueError, match="max_running >= 1"):
        Slots(0, 3)
    with pytest.raises(ValueError, match="not running"):
        Slots(1, 1).leave(0)


# ============================================================================ the trio driver


async def test_a_queued_request_gets_the_freed_slot_and_a_cancelled_one_leaves_the_queue() -> None:
    admission = Admission(max_running=1, max_queued=2)
    order: list[str] = []
    release = trio.Event()

    async def hold(name: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with admission.slot():
            order.append(name)
            await release.wait()

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(hold, "first")
            await trio.testing.wait_all_tasks_blocked()
            leaver = trio.CancelScope()
            nursery.start_soon(_cancelled_waiter, admission, leaver)
            await trio.testing.wait_all_tasks_blocked()
            await nursery.start(hold, "second")
            await trio.testing.wait_all_tasks_blocked()
            assert (admission.running, admission.queued) == (1, 2)
            with pytest.raises(Overloaded) as full:
                async with admission.slot():
                    pass
            assert full.value.status == 503 and int(full.value.headers["Retry-After"]) >= 1
            leaver.cancel()  # the waiter queued first gives up: "second" is next
            await trio.testing.wait_all_tasks_blocked()
            assert admission.queued == 1
            release.set()
    assert order == ["first", "second"]
    assert (admission.running, admission.queued) == (0, 0)


async def test_a_request_waits_for_the_tokens_it_needs_and_one_alone_always_runs() -> None:
    admission = Admission(max_running=4, max_queued=4, max_tokens=100, reserve_tokens=10)
    assert admission.need(30, 500) == 40 and admission.need(30, 4) == 34
    with trio.fail_after(GUARD_S):
        async with admission.slot(150):  # over the budget, but alone: the node can hold it
            assert admission.tokens == 150
        async with admission.slot(60):
            assert admission.slots.arrive(-1, 50) == "queued"  # 110 > 100: it waits its turn
            assert admission.slots.withdraw(-1) == []
    assert (admission.running, admission.tokens, admission.queued) == (0, 0, 0)


async def _cancelled_waiter(admission: Admission, scope: trio.CancelScope) -> None:
    with scope:
        async with admission.slot():
            raise AssertionError("a waiter cancelled while queued must never run")


# ============================================================================ the app


@contextlib.asynccontextmanager
async def live(backend: FakeBackend, **kwargs: Any) -> AsyncIterator[str]:
    app = create_app(backend, ByteCodec(), model_name="fake-echo", **kwargs)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, app, "127.0.0.1", 0)
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


@attrs.define
class GatedBackend(FakeBackend):
    """The fake, holding every request before its first token until `gate` is set."""

    gate: trio.Event = attrs.field(factory=trio.Event)

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        self.requests.append(req)
        await self.gate.wait()
        self.requests.pop()  # FakeBackend records it again
        async with contextlib.aclosing(FakeBackend.generate(self, req)) as events:
            async for event in events:
                yield event


def gauges(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if set(sample.labels) <= {"model_name"}:
                out[sample.name] = sample.value
    return out


async def test_a_full_queue_answers_503_with_retry_after_at_once_and_the_gauges_move() -> None:
    backend = GatedBackend()
    admission = Admission(max_running=1, max_queued=1)
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": 4}, "stream": True}
    async with live(backend, admission=admission) as url, httpx2.AsyncClient(timeout=GUARD_S) as http:
        streams: list[int] = []

        async def stream_one() -> None:
            async with http.stream("POST", url + "/generate", json=body) as response:
                streams.append(response.status_code)
                async for _ in response.aiter_lines():
                    pass

        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_one)
                while admission.running < 1:
                    await trio.sleep(0.01)
                nursery.start_soon(stream_one)
                while admission.queued < 1:
                    await trio.sleep(0.01)
                seen = len(backend.requests)
                refused = await http.post(url + "/v1/completions", json={"model": "fake-echo", "prompt": "x"})
                assert refused.status_code == 503
                assert int(refused.headers["retry-after"]) >= 1
                assert refused.json()["error"]["code"] == "overloaded"
                assert len(backend.requests) == seen  # the refused request never reached the backend
                now = gauges((await http.get(url + "/metrics")).text)
                assert now["sglang:num_running_reqs"] == 1 and now["sglang:num_queue_reqs"] == 1
                assert now["hicache_requests_queued"] == 1 and now["hicache_max_queued_requests"] == 1
                assert now["sglang:queue_time_seconds_count"] == 1  # the running one waited 0 s
                backend.gate.set()
        text = (await http.get(url + "/metrics")).text
    after = gauges(text)
    assert streams == [200, 200]
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
    assert after["sglang:queue_time_seconds_count"] == 2
    assert after["sglang:queue_time_seconds_sum"] > 0  # the second one waited for the first
    overloaded = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "hicache_requests_total" and s.labels.get("outcome") == "overloaded"
    ]
    assert overloaded == [1.0]


async def test_a_client_leaving_while_queued_frees_its_place() -> None:
    backend = GatedBackend()
    admission = Admission(max_running=1, max_queued=1)
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}, "stream": True}
    async with live(backend, admission=admission) as url, httpx2.AsyncClient(timeout=GUARD_S) as http:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:

                async def first() -> None:
                    async with http.stream("POST", url + "/generate", json=body) as response:
                        async for _ in response.aiter_lines():
                            pass

                nursery.start_soon(first)
                while admission.running < 1:
                    await trio.sleep(0.01)
                with trio.move_on_after(0.3):  # this client gives up while it waits in the queue
                    await http.post(url + "/generate", json=body)
                while admission.queued:
                    await trio.sleep(0.01)
                assert len(backend.requests) == 1  # the one that left never reached the backend
                backend.gate.set()
        assert admission.running == 0


async def test_health_answers_503_naming_the_node_that_is_down() -> None:
    health = Health()
    async with live(FakeBackend(), health=health) as url, httpx2.AsyncClient(timeout=GUARD_S) as http:
        assert (await http.get(url + "/health")).status_code == 200
        health.down("the decode node", "exited with status -9 (SIGKILL)")
        for path in ("/health", "/health_generate"):
            answer = await http.get(url + path)
            assert answer.status_code == 503
            assert "the decode node: exited with status -9 (SIGKILL)" in answer.json()["error"]["message"]
        health.up("the decode node")
        assert (await http.get(url + "/health")).status_code == 200
        assert (await http.get(url + "/health_generate")).status_code == 200
