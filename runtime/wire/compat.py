"""What two nodes must agree on before KV can move between them, checked at connect.

A decode node whose pages are 32 tokens cannot use pages a prefill node cuts at 16; KV computed
by another model, laid out in another dtype, or sent by another transfer engine is just as
useless, and before this check every such pairing said it was ready and then failed every
request. Each side sends its `profile` in the control connection's hello and refuses a peer whose
profile differs, with one line naming the field and both values.
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.model.llama import TinyConfig
from hicache.runtime.wire.protocol import VERSION

FIELDS = ("protocol", "engine", "page_size", "layers", "kv_heads", "head_dim", "dtype", "model")


def engine_kind(engine: object) -> str:
    """The transfer engine's kind as peers name it ("tcp", "nixl", ...): a subclass of an engine
    speaks its wire format."""
    return str(getattr(engine, "kind", type(engine).__name__))


def model_fingerprint(config: TinyConfig) -> str:
    """A short digest of everything that makes two models compute the same KV."""
    text = repr(sorted(attrs.asdict(config).items()))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def profile(
    layout: KVLayout, engine: object, model: TinyConfig, *, shard: dict[str, Any] | None = None
) -> dict[str, Any]:
    """This node's side of the agreement, as plain JSON values. A rank of a tensor-parallel
    decode node adds its `shard` (rank, size and the KV heads [lo, hi) its pages hold) and
    states the whole model's heads: its own layout holds only its part of them."""
    out = {
        "protocol": VERSION,
        "engine": engine_kind(engine),
        "page_size": layout.page_size,
        "layers": layout.layers,
        "kv_heads": layout.kv_heads if shard is None else model.kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "model": model_fingerprint(model),
    }
    if shard is not None:
        out["shard"] = shard
    return out


def shard_heads(theirs: dict[str, Any], kv_heads: int) -> str | None:
    """Why a peer's `shard` is unusable with a model of `kv_heads` KV heads (None: usable, or
    no shard at all)."""
    shard = theirs.get("shard")
    if shard is None:
        return None
    try:
        rank, size, (lo, hi) = int(shard["rank"]), int(shard["size"]), shard["heads"]
        ok = (
            0 <= rank < size
            and size >= 1
            and kv_heads % size == 0
            and (lo, hi)
            == (
                rank * kv_heads // size,
                (rank + 1) * kv_heads // size,
            )
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        return f"shard {shard!r} is not a rank's part of {kv_heads} KV heads"
    return None


def mismatch(mine: dict[str, Any], theirs: object, peer: str) -> str | None:
    """Why a peer's profile cannot work with this node's (None when it can)."""
    if not isinstance(theirs, dict):
        return f"{peer} sent no node profile (an older or foreign node): expected {', '.join(FIELDS)}"
    for name in FIELDS:
        if theirs.get(name) != mine[name]:
            return f"{name} differs: {mine[name]!r} here, {theirs.get(name)!r} at {peer}"
    return None
