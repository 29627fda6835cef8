"""Mutual challenge–response over the cluster secret, as the first frames of a control connection.

    acceptor  -> {"op": "challenge", "nonce": a}
    initiator -> {"op": "auth", "nonce": b, "proof": MAC("initiator", a, b)}
    acceptor  -> {"op": "auth", "proof": MAC("acceptor", a, b)}

Each side's proof covers both fresh nonces, so an eavesdropper's recording answers no later
challenge, and the role is in the MAC's personalisation, so a proof reflected back to its sender
is wrong. The acceptor checks the initiator's proof before it reads anything else from it (a
hello, a transfer engine's address); the initiator checks the acceptor's before it trusts the
hello that follows. The steps are plain functions of messages (`challenge`, `answer`,
`check_answer`, `check_proof`), which `accept` and `initiate` run over a connection. A failure
is an `AuthError`, which the node logs and answers like any other
protocol error: it ends that connection only.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.wire import protocol

NONCE_BYTES = 16
_INITIATOR = b"hicache-ctl-init"
_ACCEPTOR = b"hicache-ctl-acc"

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class AuthError(protocol.ProtocolError):
    """The peer did not prove that it holds the cluster secret (or refused this node's proof)."""


def _hex(msg: dict[str, Any], name: str, size: int) -> bytes:
    value = msg.get(name)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise AuthError(f"message {protocol.show(msg.get('op'))}: field {name!r} must be {size} bytes of hex")
    return raw


def _expect(msg: dict[str, Any], op: str, peer: str) -> None:
    if msg.get("op") == "error":
        raise AuthError(f"{peer} refused the connection: {protocol.clip(str(msg.get('reason')))}")
    if msg.get("op") != op:
        raise AuthError(f"expected {op!r} from {peer}, got {protocol.show(msg.get('op'))}")


def challenge() -> tuple[dict[str, Any], bytes]:
    """The acceptor's first message, and its nonce (kept to check the answer)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return {"op": "challenge", "nonce": nonce.hex()}, nonce


def answer(secret: ClusterSecret, msg: dict[str, Any], peer: str) -> tuple[dict[str, Any], bytes]:
    """The initiator's answer to a challenge, and the proof it then expects from the acceptor."""
    _expect(msg, "challenge", peer)
    theirs = _hex(msg, "nonce", NONCE_BYTES)
    mine = secrets.token_bytes(NONCE_BYTES)
    reply = {"op": "auth", "nonce": mine.hex(), "proof": secret.mac(_INITIATOR, theirs, mine).hex()}
    return reply, secret.mac(_ACCEPTOR, theirs, mine)


def check_answer(secret: ClusterSecret, nonce: bytes, msg: dict[str, Any], peer: str) -> dict[str, Any]:
    """The acceptor's check of the initiator's answer to `nonce`; its own proof in return."""
    _expect(msg, "auth", peer)
    theirs = _hex(msg, "nonce", NONCE_BYTES)
    if not hmac.compare_digest(_hex(msg, "proof", 32), secret.mac(_INITIATOR, nonce, theirs)):
        raise AuthError(f"{peer} does not hold this node's cluster secret")
    return {"op": "auth", "proof": secret.mac(_ACCEPTOR, nonce, theirs).hex()}


def check_proof(expected: bytes, msg: dict[str, Any], peer: str) -> None:
    """The initiator's check of the acceptor's proof."""
    _expect(msg, "auth", peer)
    if not hmac.compare_digest(_hex(msg, "proof", 32), expected):
        raise AuthError(f"{peer} does not hold this node's cluster secret")


async def accept(secret: ClusterSecret, send: Send, receive: Receive, peer: str) -> None:
    """The acceptor's side: challenge, check the initiator's proof, prove in turn."""
    msg, nonce = challenge()
    await send(msg)
    await send(check_answer(secret, nonce, await receive(), peer))


async def initiate(secret: ClusterSecret, send: Send, receive: Receive, peer: str) -> None:
    """The initiator's side: answer the challenge, then check the acceptor's proof."""
    msg, expected = answer(secret, await receive(), peer)
    await send(msg)
    check_proof(expected, await receive(), peer)
