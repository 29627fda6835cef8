"""A transfer-engine peer in its own process, driven by the transfer tests over stdin/stdout.

    python tests/transfer_peer.py --engine tcp|nixl --name NAME --pages N --page-bytes B --seed S

It starts an engine, registers a region "pool" holding `initial_pages(seed, N, B)` (zeros when
the seed is negative), prints
`@INFO <local_info hex>` and then answers one command per stdin line until stdin closes:

    ADD <hex>        add a peer from its local_info         -> @PEER <name>
    SUM <i,j,...>    blake2b digests of those pool pages    -> @SUM <hex,hex,...>
    NOTIF <seconds>  wait for the next notification         -> @NOTIF <peer> <hex> | @NONE
    NOTIFS           the notifications queued right now     -> @NOTIFS <peer>:<hex> ...

Replies start with "@" so that anything else a library prints on stdout is ignored. The process
ends with `os._exit`, since NIXL/UCX can crash in library teardown at interpreter exit on some
hosts after the work itself succeeded. The peer serves only engines it was told about with ADD,
and proves (as they must) that it holds the cluster secret of the environment
(HICACHE_CLUSTER_SECRET, which the tests set).

It also holds the tests' hand-written side of the TCP engine's handshake (`wire_hello`,
`wire_initiate`, `wire_accept`), for tests that speak the wire format themselves.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from typing import TYPE_CHECKING

import numpy as np
import trio

if TYPE_CHECKING:
    from hicache.runtime.security.cluster_secret import ClusterSecret


def initial_pages(seed: int, num_pages: int, page_bytes: int) -> np.ndarray:
    if seed < 0:
        return np.zeros((num_pages, page_bytes), dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)


def digest(page: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(page).tobytes(), digest_size=16).hexdigest()


def reply(line: str) -> None:
    sys.stdout.write("@" + line + "\n")
    sys.stdout.flush()


async def recv_exactly(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = await stream.receive_some(min(n - len(buf), 1 << 16))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


async def wire_hello(
    stream: trio.abc.Stream, name: bytes, secret: ClusterSecret | None = None
) -> tuple[tuple[bytes, bytes, bytes, bytes], bool]:
    """Say HELLO as engine `name` and read the HELLO_ACK (an ERROR raises `ConnectionRefusedError`
    with its text). Returns the proof parts `(nonce_i, nonce_t, name, target)` and whether the
    target's proof is right for `secret` (default: the environment's)."""
    from hicache.runtime.security.cluster_secret import ClusterSecret
    from hicache.runtime.transfer.tcp_handshake import ACCEPTOR_PURPOSE, handshake_proof
    from hicache.runtime.transfer.tcp_wire import HEADER, NONCE_BYTES, Msg, encode_header

    secret = secret if secret is not None else ClusterSecret.load()
    nonce_i = os.urandom(NONCE_BYTES)
    await stream.send_all(encode_header(Msg.HELLO, 0, name, notif_len=NONCE_BYTES) + nonce_i)
    _, _, mtype, name_len, _, _, _, notif_len = HEADER.unpack(await recv_exactly(stream, HEADER.size))
    body = await recv_exactly(stream, name_len + notif_len)
    if mtype == Msg.ERROR:
        raise ConnectionRefusedError(body[name_len:].decode(errors="replace"))
    if mtype != Msg.HELLO_ACK:
        raise AssertionError(f"expected HELLO_ACK, got message type {mtype}")
    target, rest = body[:name_len], body[name_len:]
    nonce_t, proof = rest[:NONCE_BYTES], rest[NONCE_BYTES:]
    parts = (nonce_i, nonce_t, name, target)
    return parts, proof == handshake_proof(secret, ACCEPTOR_PURPOSE, *parts)


async def wire_initiate(stream: trio.abc.Stream, name: bytes, secret: ClusterSecret | None = None) -> bytes:
    """The initiator's side of the handshake by hand, as engine `name`: HELLO, check HELLO_ACK,
    AUTH. Returns the AUTH proof it sent."""
    from hicache.runtime.security.cluster_secret import ClusterSecret
    from hicache.runtime.transfer.tcp_handshake import INITIATOR_PURPOSE, handshake_proof
    from hicache.runtime.transfer.tcp_wire import MAC_BYTES, Msg, encode_header

    secret = secret if secret is not None else ClusterSecret.load()
    parts, ok = await wire_hello(stream, name, secret)
    if not ok:
        raise AssertionError(f"target {parts[3]!r} sent a wrong proof in HELLO_ACK")
    auth = handshake_proof(secret, INITIATOR_PURPOSE, *parts)
    await stream.send_all(encode_header(Msg.AUTH, 0, notif_len=MAC_BYTES) + auth)
    return auth


async def read_reply(stream: trio.abc.ReceiveStream) -> tuple[int, bytes]:
    """The type and notif text of the next message, or (0, b"") at EOF."""
    from hicache.runtime.transfer.tcp_wire import HEADER

    buf = b""
    while len(buf) < HEADER.size:
        chunk = await stream.receive_some(HEADER.size - len(buf))
        if not chunk:
            return 0, b""
        buf += chunk
    _, _, mtype, name_len, _, _, _, notif_len = HEADER.unpack(buf)
    want, body = name_len + notif_len, b""
    while len(body) < want:
        chunk = await stream.receive_some(want - len(body))
        if not chunk:
            break
        body += chunk
    return mtype, body[name_len:]


async def wire_accept(stream: trio.abc.Stream, name: bytes, secret: ClusterSecret | None = None) -> bytes:
    """The target's side of the handshake by hand, as engine `name`: read HELLO, answer HELLO_ACK,
    check AUTH. Returns the initiator's name."""
    from hicache.runtime.security.cluster_secret import ClusterSecret
    from hicache.runtime.transfer.tcp_handshake import ACCEPTOR_PURPOSE, INITIATOR_PURPOSE, handshake_proof
    from hicache.runtime.transfer.tcp_wire import HEADER, MAC_BYTES, NONCE_BYTES, Msg, encode_header

    secret = secret if secret is not None else ClusterSecret.load()
    _, _, mtype, name_len, _, _, _, notif_len = HEADER.unpack(await recv_exactly(stream, HEADER.size))
    assert (mtype, notif_len) == (Msg.HELLO, NONCE_BYTES), (mtype, notif_len)
    body = await recv_exactly(stream, name_len + notif_len)
    peer, nonce_i, nonce_t = body[:name_len], body[name_len:], os.urandom(NONCE_BYTES)
    parts = (nonce_i, nonce_t, peer, name)
    ack = encode_header(Msg.HELLO_ACK, 0, name, notif_len=NONCE_BYTES + MAC_BYTES)
    await stream.send_all(ack + nonce_t + handshake_proof(secret, ACCEPTOR_PURPOSE, *parts))
    _, _, mtype, name_len, _, _, _, notif_len = HEADER.unpack(await recv_exactly(stream, HEADER.size))
    assert (mtype, name_len, notif_len) == (Msg.AUTH, 0, MAC_BYTES), (mtype, name_len, notif_len)
    assert await recv_exactly(stream, MAC_BYTES) == handshake_proof(secret, INITIATOR_PURPOSE, *parts)
    return peer


async def lines(stream: trio.abc.ReceiveStream):  # noqa: ANN201 - async generator of str
    buf = b""
    while True:
        chunk = await stream.receive_some(1 << 16)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()


async def serve(args: argparse.Namespace) -> None:
    from hicache.runtime.transfer import NixlEngine, TcpEngine

    engine = TcpEngine(name=args.name) if args.engine == "tcp" else NixlEngine(args.name)
    pool = initial_pages(args.seed, args.pages, args.page_bytes)
    async with engine:
        engine.register("pool", pool)
        reply("INFO " + engine.local_info().hex())
        async for line in lines(trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))):
            cmd, _, rest = line.strip().partition(" ")
            if cmd == "ADD":
                reply("PEER " + await engine.add_peer(bytes.fromhex(rest)))
            elif cmd == "SUM":
                pages = [int(p) for p in rest.split(",") if p]
                reply("SUM " + ",".join(digest(pool[p]) for p in pages))
            elif cmd == "NOTIF":
                with trio.move_on_after(float(rest)):
                    peer, msg = await engine.next_notif()
                    reply(f"NOTIF {peer} {msg.hex()}")
                    continue
                reply("NONE")
            elif cmd == "NOTIFS":
                reply(" ".join(["NOTIFS"] + [f"{p}:{m.hex()}" for p, m in engine.notifs()]))
            else:
                reply(f"ERROR unknown command {cmd!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("tcp", "nixl"), required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--page-bytes", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rc = 0
    try:
        trio.run(serve, args)
    except BaseException as e:  # noqa: BLE001 - report, then leave without library teardown
        print(f"transfer_peer: {e!r}", file=sys.stderr)
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    main()
