"""Peers prove they hold the cluster secret; a known engine name is never rebound; a received page
that is not what prefill sent is never served.

Before: any local process could say hello to a prefill node and bind any engine name (one hello
carrying the decode engine's name diverted its KV), and received pages were compared with
prefill's digests only when faults were injected.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio
import trio.testing
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from node_pair import GUARD_S, PAGE, authenticated, node_pair, prompt, small_core, turn

from hicache.runtime.decode.decode_node import DecodeService
from hicache.runtime.lone_error import sole
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.prefill import kv_out
from hicache.runtime.prefill.prefill_node import PrefillNode
from hicache.runtime.security import peer_auth
from hicache.runtime.security.cluster_secret import ClusterSecret, UntrustedSecret, default_path
from hicache.runtime.security.limits import Limits
from hicache.runtime.storage.memory_store import MemoryStore
from hicache.runtime.transfer.base import PeerInfo
from hicache.runtime.transfer.tcp import TcpEngine
from hicache.runtime.wire import compat, protocol

# ============================================================================ the secret


def test_the_secret_comes_from_the_file_then_the_environment_then_the_default_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given_file = tmp_path / "given"
    given_file.write_text("from-a-file-of-secrets\n")
    given_file.chmod(0o600)
    monkeypatch.setenv("HICACHE_CLUSTER_SECRET", "from-the-environment")
    assert ClusterSecret.load(given_file) == ClusterSecret.of("from-a-file-of-secrets", "x")
    assert ClusterSecret.load() == ClusterSecret.of("from-the-environment")
    monkeypatch.delenv("HICACHE_CLUSTER_SECRET")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    first = ClusterSecret.load()
    assert default_path().stat().st_mode & 0o777 == 0o600
    assert ClusterSecret.load() == first  # created once, then read: two nodes of one user agree
    assert first != ClusterSecret.of("from-the-environment")


def test_a_secret_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("s3cret")
    path.chmod(0o644)
    with pytest.raises(UntrustedSecret, match=r"secret: mode 0644 lets others read or change it"):
        ClusterSecret.load(path)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(UntrustedSecret, match="holds 0 bytes besides surrounding whitespace, expected 16"):
        ClusterSecret.load(empty)


def test_the_secret_never_shows_in_a_repr() -> None:
    secret = ClusterSecret.of("hunter2-hunter2")
    assert "hunter2" not in repr(secret) and secret.key.hex() not in repr(secret)


# ============================================================================ the handshake


async def handshake(a: ClusterSecret, b: ClusterSecret) -> tuple[BaseException | None, BaseException | None]:
    """Run both sides over a memory stream pair; what each side raised (None: it succeeded)."""
    left, right = trio.testing.memory_stream_pair()
    out: list[BaseException | None] = [None, None]

    def side(stream: trio.abc.Stream):
        reader = protocol.FrameReader(stream)

        async def send(msg: dict) -> None:
            await protocol.send(stream, msg)

        async def receive() -> dict:
            return (await reader.receive())[0]

        return send, receive

    async def run(i: int, fn, secret: ClusterSecret, stream: trio.abc.Stream) -> None:
        try:
            await fn(secret, *side(stream), "the peer")
        except (protocol.ProtocolError, EOFError) as exc:
            out[i] = exc
            await stream.aclose()

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, 0, peer_auth.accept, a, left)
            nursery.start_soon(run, 1, peer_auth.initiate, b, right)
    return out[0], out[1]


async def test_the_handshake_passes_with_one_secret_and_fails_with_two() -> None:
    same = ClusterSecret.of("one")
    assert await handshake(same, same) == (None, None)
    acceptor, initiator = await handshake(ClusterSecret.of("one"), ClusterSecret.of("two"))
    assert isinstance(acceptor, peer_auth.AuthError) and "does not hold" in str(acceptor)
    assert initiator is not None  # it learns nothing and gets no proof


@settings(max_examples=examples(50), deadline=None)
@given(nonce=st.binary(min_size=16, max_size=16), proof=st.binary(min_size=32, max_size=32))
def test_no_guessed_proof_authenticates(nonce: bytes, proof: bytes) -> None:
    async def main() -> None:
        left, right = trio.testing.memory_stream_pair()
        reader = protocol.FrameReader(right)

        async def attacker() -> None:
            await reader.receive()  # the challenge
            await protocol.send(right, {"op": "auth", "nonce": nonce.hex(), "proof": proof.hex()})

        left_reader = protocol.FrameReader(left)

        async def send(msg: dict) -> None:
            await protocol.send(left, msg)

        async def receive() -> dict:
            return (await left_reader.receive())[0]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(attacker)
            with pytest.raises(peer_auth.AuthError, match="does not hold"):
                await peer_auth.accept(ClusterSecret.of("the real one"), send, receive, "attacker")

    trio.run(main)


# ============================================================================ at the prefill node


async def test_prefill_acts_on_no_hello_before_its_sender_proved_the_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with node_pair(tmp_path, storage=False) as pair, TcpEngine(name="stranger") as stranger:
        p = pair.prefill
        mine = compat.profile(p.layout, stranger, p.model.config)
        hello = {"op": "hello", "info": stranger.local_info().hex(), "profile": mine}
        for secret in (None, ClusterSecret.of("a guess")):
            stream, reader = await authenticated(pair.prefill_port, None)
            async with stream:
                challenge, _ = await reader.receive()
                assert challenge["op"] == "challenge"
                if secret is None:  # skip the proof: say hello straight away
                    await protocol.send(stream, hello)
                else:
                    nonce = bytes.fromhex(challenge["nonce"])
                    proof = secret.mac(b"hicache-ctl-init", nonce, bytes(16)).hex()
                    await protocol.send(stream, {"op": "auth", "nonce": "00" * 16, "proof": proof})
                with trio.fail_after(GUARD_S):
                    answer, _ = await reader.receive()
            assert answer["op"] == "error", answer
            assert ("expected 'auth'" if secret is None else "does not hold") in answer["reason"]
        assert "stranger" not in p.engine._peers  # never learned: it could not have been written to
        assert (await turn(pair.client, pair.ledger, "after", prompt(3)))["outcome"] == "finished"


async def test_a_decode_node_with_another_secret_cannot_start() -> None:
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    async with (
        TcpEngine(name="prefill", secret=ClusterSecret.of("ours")) as p_engine,
        TcpEngine(name="decode", secret=ClusterSecret.of("theirs")) as d_engine,
        trio.open_nursery() as nursery,
    ):
        prefill = PrefillNode(model, layout, p_engine, staging_pages=16, secret=ClusterSecret.of("ours"))
        port = (await nursery.start(prefill.serve, 0))[0].socket.getsockname()[1]
        service = DecodeService(
            small_core(), model, layout, MemoryStore(layout), d_engine, secret=ClusterSecret.of("theirs")
        )
        with pytest.raises(BaseException) as raised:  # noqa: PT011  (unwrapped below)
            with trio.fail_after(GUARD_S):
                await service.run(0, ("127.0.0.1", port))
        err = sole(raised.value)
        assert isinstance(err, peer_auth.AuthError), err
        assert "does not hold this node's cluster secret" in str(err)
        assert not p_engine._peers  # prefill learned nothing of it
        nursery.cancel_scope.cancel()


async def test_a_known_engine_name_is_not_rebound_by_another_peer(tmp_path: Path) -> None:
    """A peer holding the secret says hello with the decode engine's name and its own address:
    refused, and the decode node's KV keeps going to the decode node."""
    async with node_pair(tmp_path, storage=False) as pair, TcpEngine(name="impostor") as impostor:
        assert (await turn(pair.client, pair.ledger, "before", prompt(1)))["outcome"] == "finished"
        p = pair.prefill
        real = pair.service.engine.name
        impostor.register("L1", np.zeros((8, p.layout.page_bytes), dtype=np.uint8))
        info = attrs.evolve(PeerInfo.decode(impostor.local_info()), name=real).encode()
        stream, reader = await authenticated(pair.prefill_port, p.secret)
        async with stream:
            mine = compat.profile(p.layout, impostor, p.model.config)
            await protocol.send(stream, {"op": "hello", "info": info.hex(), "profile": mine})
            with trio.fail_after(GUARD_S):
                answer, _ = await reader.receive()
        assert answer["op"] == "error" and "cannot be rebound" in answer["reason"], answer
        assert (await turn(pair.client, pair.ledger, "after", prompt(2)))["outcome"] == "finished"


# ============================================================================ received pages


async def test_a_page_that_is_not_what_prefill_sent_is_never_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill's digests disagree with the pages that land (as if a page were altered on the
    way): with no fault injection at all, the transfer fails and its retries fail; the request
    fails with the reason instead of decoding from those pages."""
    real = kv_out.page_digests

    def lying(pages):
        return ["0" * 32 for _ in real(pages)]

    monkeypatch.setattr(kv_out, "page_digests", lying)
    async with node_pair(tmp_path, storage=False, retries=1) as pair:
        assert pair.service.faults is None and not pair.service.check_pages
        with trio.fail_after(GUARD_S):
            reply, _ = await pair.client.generate("r", prompt(4), 2)
        assert reply["outcome"] == "failed"
        assert "differs from what prefill sent" in reply["reason"], reply["reason"]
        monkeypatch.setattr(kv_out, "page_digests", real)
        assert (await turn(pair.client, pair.ledger, "fine", prompt(5)))["outcome"] == "finished"


async def test_a_prefill_that_accepts_and_says_nothing_does_not_hold_the_decode_node() -> None:
    """Before, a decode node's start-up (or a transfer reconnecting) waited for the challenge
    forever; now it gives up after the frame timeout, with the reason."""
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    async with TcpEngine(name="decode") as engine, trio.open_nursery() as nursery:

        async def silent(stream: trio.SocketStream) -> None:
            await trio.sleep_forever()

        port = (await nursery.start(trio.serve_tcp, silent, 0))[0].socket.getsockname()[1]
        service = DecodeService(
            small_core(), model, layout, MemoryStore(layout), engine, limits=Limits(frame_timeout_s=0.3)
        )
        with pytest.raises(BaseException) as raised:  # noqa: PT011  (unwrapped below)
            with trio.fail_after(GUARD_S):
                await service.run(0, ("127.0.0.1", port))
        err = sole(raised.value)
        assert isinstance(err, protocol.ProtocolError), err
        assert f"the prefill node at 127.0.0.1:{port} said nothing for 0.3 s" in str(err)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("secret", ["x", "only-15-bytes!!", "  short  \n"])
def test_a_short_secret_is_refused_naming_where_it_came_from(
    secret: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, finding 10: a 1-byte cluster secret was accepted (one recorded handshake then
    gives it away offline). From a file or the environment, below 16 bytes it is refused."""
    path = tmp_path / "secret"
    path.write_text(secret)
    path.chmod(0o600)
    with pytest.raises(UntrustedSecret, match=rf"{path}: holds \d+ bytes .* expected 16"):
        ClusterSecret.load(path)
    monkeypatch.setenv("HICACHE_CLUSTER_SECRET", secret)
    with pytest.raises(UntrustedSecret, match=r"HICACHE_CLUSTER_SECRET: holds \d+ bytes .* expected 16"):
        ClusterSecret.load()


@pytest.mark.parametrize("blank", [" ", "\t\n  "])
def test_a_whitespace_only_secret_in_the_environment_is_refused_not_passed_over(
    blank: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, finding 10: a whitespace-only HICACHE_CLUSTER_SECRET silently fell back to the
    default file; an operator who set the variable meant a secret of their own."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HICACHE_CLUSTER_SECRET", blank)
    with pytest.raises(UntrustedSecret, match="HICACHE_CLUSTER_SECRET: holds 0 bytes"):
        ClusterSecret.load()
    assert not default_path().exists()
    monkeypatch.setenv("HICACHE_CLUSTER_SECRET", "")  # empty: unset, as shells write it
    assert ClusterSecret.load().source == str(default_path())
