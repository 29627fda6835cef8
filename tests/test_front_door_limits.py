"""What a client may hold at the front door (runtime/serving/door.py, token_rate.py, the
admission queue's timeout, sse.py's stalled streams), on a live server in this trio run, with
raw sockets where a real client would not misbehave. Issue 30's findings 2, 3 and 6.

Timeouts here are made small so that the tests are short; the guards only stop hangs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_fakes import ByteCodec, FakeBackend
from starlette.applications import Starlette

from hicache.runtime.security.api_keys import Principal
from hicache.runtime.serving import create_app, serve_http
from hicache.runtime.serving.admission import Admission
from hicache.runtime.serving.door import DoorLimits
from hicache.runtime.serving.token_rate import TokenRate

MODEL = "fake-echo"
GUARD_S = 20


class CountingCodec(ByteCodec):
    """ByteCodec that counts the texts it tokenized."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return super().encode(text)


@contextlib.asynccontextmanager
async def live(
    backend: FakeBackend | None = None, codec: ByteCodec | None = None, **kwargs: Any
) -> AsyncIterator[tuple[str, int, Starlette, FakeBackend]]:
    backend = FakeBackend() if backend is None else backend
    app = create_app(backend, codec or ByteCodec(), model_name=MODEL, **kwargs)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, app, "127.0.0.1", 0)
        yield f"http://127.0.0.1:{port}", port, app, backend
        nursery.cancel_scope.cancel()


async def poll(condition: Any) -> None:
    with trio.fail_after(GUARD_S):
        while not condition():
            await trio.sleep(0.01)


def head(path: str, length: int | None, extra: str = "") -> bytes:
    size = "" if length is None else f"Content-Length: {length}\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}{extra}\r\n").encode(
        "ascii"
    )


async def answer(stream: trio.SocketStream) -> tuple[int, bytes]:
    """The status and the bytes of the response (until the server closes or the body ends)."""
    data = b""
    with trio.fail_after(GUARD_S):
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
        status = int(data.split(b" ", 2)[1]) if data else 0
        headers, _, body = data.partition(b"\r\n\r\n")
        for line in headers.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                while len(body) < int(line.split(b":")[1]):
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        break
                    body += chunk
    return status, headers + b"\r\n\r\n" + body


# ============================================================================ finding 2


async def test_a_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized() -> None:
    """A 16 MiB text was tokenized before any length check (4.37 GB peak, 70 s for others)."""
    codec = CountingCodec()
    async with (
        live(FakeBackend(max_context=1000), codec) as (url, _, _, backend),
        httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as c,
    ):
        for path, body in [
            ("/generate", {"text": "x" * 1_000_000}),
            ("/v1/completions", {"prompt": "x" * 1_000_000}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1_000_000}]}),
        ]:
            r = await c.post(path, json=body)
            assert r.status_code == 400 and "no room to generate" in r.json()["error"]["message"], r.text
        assert codec.encoded == 0 and not backend.requests
        ok = await c.post("/generate", json={"text": "short", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200 and codec.encoded == 1


async def test_a_wrong_key_is_refused_before_the_body_is_read() -> None:
    """With API keys the 401 came only after the whole body was read."""
    keys = {"sk-good": Principal(tenant="acme", admin=False)}
    async with live(api_keys=keys) as (_, port, app, _):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(head("/generate", 10_000_000, "Authorization: Bearer sk-bad\r\n"))
            status, data = await answer(stream)  # not a byte of the body sent
        assert status == 401 and b"invalid_api_key" in data
        assert app.state.ctx.door.body_bytes == 0


# ============================================================================ finding 3


async def test_a_stalled_body_is_cut_off_at_its_deadline_and_holds_nothing() -> None:
    limits = DoorLimits(body_timeout_s=0.5)
    async with live(limits=limits) as (url, port, app, _):
        stalled = []
        for length, first in [(1000, b'{"text": "'), (None, b"")]:  # a short body; a chunked one
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            chunked = "Transfer-Encoding: chunked\r\n" if length is None else ""
            await stream.send_all(head("/generate", length, chunked) + (first or b"5\r\nhello\r\n"))
            stalled.append(stream)
        for stream in stalled:
            status, data = await answer(stream)
            assert status == 408 and b"body_timeout" in data
            await stream.aclose()
        door = app.state.ctx.door
        await poll(lambda: door.open == 0 and door.body_bytes == 0)
        async with httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as c:
            assert (await c.post("/generate", json={"text": "hi"})).status_code == 200


async def test_bodies_held_at_once_and_requests_open_at_once_are_capped() -> None:
    """20 connections each holding 15 MiB of body took serve from 332 to 629 MB, for good."""
    limits = DoorLimits(body_bytes_in_flight=100_000, max_connections=3, body_timeout_s=GUARD_S)
    async with live(limits=limits) as (url, port, app, _):
        door = app.state.ctx.door
        first = await trio.open_tcp_stream("127.0.0.1", port)
        await first.send_all(head("/generate", 200_000) + b'{"text": "' + b"x" * 60_000)
        await poll(lambda: door.body_bytes >= 60_000)
        second = await trio.open_tcp_stream("127.0.0.1", port)
        await second.send_all(head("/generate", 200_000) + b'{"text": "' + b"x" * 60_000)
        status, data = await answer(second)
        assert status == 503 and b"too_many_body_bytes" in data and b"retry-after" in data.lower()
        assert door.peak_body_bytes <= 100_000
        await second.aclose()
        await poll(lambda: door.open == 1)
        more = []
        for _ in range(2):
            more.append(await trio.open_tcp_stream("127.0.0.1", port))
            await more[-1].send_all(head("/generate", 10))
            await poll(lambda: door.open == len(more) + 1)
        over = await trio.open_tcp_stream("127.0.0.1", port)
        await over.send_all(head("/generate", 10))
        status, data = await answer(over)  # before its body: nothing of it was sent
        assert status == 503 and b"too_many_connections" in data
        async with httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as c:
            assert (await c.get("/health")).status_code == 200  # a probe is never refused
            for s in [first, over, *more]:
                await s.aclose()
            await poll(lambda: door.open == 0 and door.body_bytes == 0)
            assert (await c.post("/generate", json={"text": "hi"})).status_code == 200


# ============================================================================ finding 6


async def test_one_caller_cannot_hold_more_than_its_share_of_requests() -> None:
    limits = DoorLimits(max_requests_per_tenant=1, body_timeout_s=GUARD_S)
    async with live(limits=limits) as (url, port, app, _):
        hold = await trio.open_tcp_stream("127.0.0.1", port)
        await hold.send_all(head("/generate", 100, "Authorization: Bearer alice\r\n"))
        await poll(lambda: app.state.ctx.door.open == 1)
        async with httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as c:
            r = await c.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer alice"})
            assert r.status_code == 429 and r.headers["Retry-After"] and r.json()["error"]["code"]
            r = await c.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer bob"})
            assert r.status_code == 200
            await hold.aclose()
            await poll(lambda: app.state.ctx.door.open == 0)
            r = await c.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer alice"})
            assert r.status_code == 200


async def test_a_callers_token_rate_is_limited_with_a_429_and_retry_after() -> None:
    async with (
        live(rate=TokenRate(100)) as (url, _, _, _),
        httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as c,
    ):
        body = {"text": "x" * 20, "sampling_params": {"max_new_tokens": 30}}  # 50 tokens asked
        assert (await c.post("/generate", json=body)).status_code == 200
        assert (await c.post("/generate", json=body)).status_code == 200
        r = await c.post("/generate", json=body)
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1 and "tokens a minute" in r.json()["error"]["message"]
        other = await c.post("/generate", json=body, headers={"Authorization": "Bearer other"})
        assert other.status_code == 200  # another caller's bucket


async def test_a_request_queued_past_the_queue_timeout_gets_a_503() -> None:
    admission = Admission(1, 4, queue_timeout_s=0.3)
    async with (
        live(FakeBackend(delay_s=0.05), admission=admission) as (url, _, _, backend),
        httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as c,
        trio.open_nursery() as n,
    ):
        long = {"text": "abc", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        n.start_soon(functools.partial(c.post, "/generate", json=long))
        await poll(lambda: backend.active)
        r = await c.post("/generate", json={"text": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text
        assert r.headers["Retry-After"] and admission.queued == 0
        n.cancel_scope.cancel()


async def test_a_stream_whose_client_stops_reading_is_aborted(caplog: pytest.LogCaptureFixture) -> None:
    """40 streams that read nothing kept generating for nobody."""
    caplog.set_level(logging.WARNING)
    backend = FakeBackend(max_context=100_000)
    async with live(backend, stream_stall_timeout_s=0.5) as (_, port, _, _):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        await stream.socket.connect(("127.0.0.1", port))
        body = json.dumps({"text": "abcdefgh", "stream": True, "sampling_params": {"max_new_tokens": 90_000}})
        await stream.send_all(head("/generate", len(body)) + body.encode())
        await poll(lambda: backend.aborted)  # read nothing: the generation was stopped
        assert not backend.active
        assert any("read nothing for 0.5 s" in r.getMessage() for r in caplog.records)
        await stream.aclose()


# ============================================================================ any client (hypothesis)

_behaviour = st.fixed_dictionaries(
    {
        "path": st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions", "/metrics"]),
        "declared": st.none() | st.integers(0, 5000),
        "chunked": st.booleans(),
        "body": st.binary(max_size=3000),
        "headers": st.lists(
            st.sampled_from(["Authorization: Bearer x", "Expect: 100-continue", "X: " + "y" * 200]),
            max_size=3,
        ),
        "bad_chunk": st.booleans(),
        "then": st.sampled_from(["close", "stall", "half_close", "read"]),
    }
)


async def _hostile(port: int, b: dict[str, Any]) -> None:
    extra = "".join(h + "\r\n" for h in b["headers"])
    if b["chunked"]:
        extra += "Transfer-Encoding: chunked\r\n"
        body = b"zz\r\n" + b["body"] if b["bad_chunk"] else b"%x\r\n" % len(b["body"]) + b["body"] + b"\r\n"
        data = head(b["path"], None, extra) + body
    else:
        data = head(b["path"], b["declared"], extra) + b["body"]
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(data)
            if b["then"] == "half_close":
                await stream.send_eof()
            if b["then"] in ("read", "half_close"):
                with trio.move_on_after(2):
                    await answer(stream)
            elif b["then"] == "stall":
                await trio.sleep(0.3)


def test_hostile_clients_leave_the_front_door_responsive_and_holding_nothing() -> None:
    """Generated bodies, headers and connection behaviours (partial and oversize bodies, bad
    chunking, stalls, early and half closes) against one live server: after each, it answers
    a normal request and holds no request, body byte or generation."""

    async def main() -> None:
        limits = DoorLimits(max_body_bytes=2000, body_timeout_s=0.5)
        async with live(FakeBackend(max_context=200), limits=limits) as (url, port, app, backend):
            door = app.state.ctx.door
            async with httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as c:
                token = trio.lowlevel.current_trio_token()

                @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
                @given(b=_behaviour)
                def one(b: dict[str, Any]) -> None:
                    trio.from_thread.run(_hostile, port, b, trio_token=token)

                await trio.to_thread.run_sync(one)
                await poll(lambda: door.open == 0 and door.body_bytes == 0 and not backend.active)
                r = await c.post(
                    "/generate", json={"text": "still", "sampling_params": {"max_new_tokens": 3}}
                )
                assert r.status_code == 200 and r.json()["text"] == "sti"

    trio.run(main)
