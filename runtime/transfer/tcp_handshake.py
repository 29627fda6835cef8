"""How a TCP engine connection opens: a mutual challenge–response over the cluster secret
(`runtime/security/cluster_secret.py`), all of it within the handshake timeout on both sides:

    initiator -> HELLO      name = name_i, notif = nonce_i (16 bytes)
    target    -> HELLO_ACK  name = name_t, notif = nonce_t (16 bytes) | MAC(acceptor, ...)
    initiator -> AUTH       notif = MAC(initiator, ...)

where both MACs are `secret.mac(role, nonce_i, nonce_t, name_i, name_t)` with the role in the
personalisation (`b"hicache-kv-acc"`, `b"hicache-kv-init"`), and both nonces fresh per
connection. The initiator checks the target's MAC before it sends AUTH (a wrong one ends the
transfer `ERR`: the peer does not hold the cluster secret); the target checks AUTH with
`hmac.compare_digest` before it reads any request. Proofs cover both fresh nonces, so a recorded
AUTH answers no later connection, and the role, so a proof reflected back is wrong.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable

from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.transfer.tcp_wire import (
    MAC_BYTES,
    NONCE_BYTES,
    Conn,
    Msg,
    ProtocolError,
    encode_header,
    error_text,
)

# BLAKE2b personalisations: a proof made in one role is never valid in the other.
INITIATOR_PURPOSE = b"hicache-kv-init"
ACCEPTOR_PURPOSE = b"hicache-kv-acc"


class HandshakeTimeout(Exception):
    """The peer accepted the connection but did not complete HELLO in time."""


def handshake_proof(
    secret: ClusterSecret, purpose: bytes, nonce_i: bytes, nonce_t: bytes, name_i: bytes, name_t: bytes
) -> bytes:
    """The MAC one side of a connection sends: `purpose` is `ACCEPTOR_PURPOSE` in HELLO_ACK and
    `INITIATOR_PURPOSE` in AUTH; the parts are the initiator's and the target's nonces and names."""
    return secret.mac(purpose, nonce_i, nonce_t, name_i, name_t)


async def initiate(conn: Conn, secret: ClusterSecret, own: bytes, target_name: str, where: str) -> None:
    """HELLO as engine `own`, check the target's proof in HELLO_ACK, then prove this side's in
    AUTH; `where` (host:port) names the target in errors."""
    target = target_name.encode("utf-8")
    nonce_i = secrets.token_bytes(NONCE_BYTES)
    hello = encode_header(Msg.HELLO, 0, own, notif_len=NONCE_BYTES)
    await conn.send([hello, nonce_i])
    f = await conn.recv_frame()
    if f.type is Msg.ERROR:
        raise ProtocolError(f"HELLO refused: {await error_text(conn, f)}")
    if f.type is not Msg.HELLO_ACK or f.name != target:
        raise ProtocolError(f"expected HELLO_ACK from {target_name!r}, got {f.type.name} {f.name!r}")
    body = bytes(await conn.recv_exactly(f.notif_len))
    nonce_t, proof = body[:NONCE_BYTES], body[NONCE_BYTES:]
    parts = (nonce_i, nonce_t, own, target)
    if not hmac.compare_digest(proof, handshake_proof(secret, ACCEPTOR_PURPOSE, *parts)):
        raise ProtocolError(
            f"{target_name!r} at {where} does not hold the cluster secret (wrong proof in HELLO_ACK)"
        )
    proof = handshake_proof(secret, INITIATOR_PURPOSE, *parts)
    await conn.send([encode_header(Msg.AUTH, 0, notif_len=MAC_BYTES), proof])


async def accept(
    conn: Conn, secret: ClusterSecret, own: bytes, own_name: str, knows: Callable[[str], bool]
) -> str:
    """The target's side, as engine `own`: returns the peer's name once it proved that it holds
    the cluster secret. Only a peer `knows` names may say HELLO, and nothing it sends after
    HELLO is read before its proof."""
    f = await conn.recv_frame(boundary=True)
    if f.type is not Msg.HELLO:
        raise ProtocolError(f"expected HELLO first, got {f.type.name}")
    try:
        peer = f.name.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("HELLO: the engine name is not UTF-8") from None
    nonce_i = bytes(await conn.recv_exactly(f.notif_len))
    if not knows(peer):
        raise ProtocolError(f"HELLO from {peer!r}: not a peer {own_name!r} knows")
    nonce_t = secrets.token_bytes(NONCE_BYTES)
    parts = (nonce_i, nonce_t, f.name, own)
    proof = handshake_proof(secret, ACCEPTOR_PURPOSE, *parts)
    ack = encode_header(Msg.HELLO_ACK, 0, own, notif_len=NONCE_BYTES + MAC_BYTES)
    await conn.send([ack, nonce_t, proof])
    f = await conn.recv_frame()
    if f.type is not Msg.AUTH:
        raise ProtocolError(f"expected AUTH from {peer!r}, got {f.type.name}")
    theirs = bytes(await conn.recv_exactly(f.notif_len))
    if not hmac.compare_digest(theirs, handshake_proof(secret, INITIATOR_PURPOSE, *parts)):
        raise ProtocolError(f"AUTH from {peer!r}: wrong proof (it does not hold the cluster secret)")
    if not knows(peer):  # removed while it proved itself
        raise ProtocolError(f"HELLO from {peer!r}: not a peer {own_name!r} knows (removed)")
    return peer
