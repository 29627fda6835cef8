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

from hicache.runtime.kv_layout import KVLayout
from hicache.runtime.model import TinyConfig
from hicache.runtime.protocol import VERSION

FIELDS = ("protocol", "engine", "page_size", "layers", "kv_heads", "head_dim", "dtype", "model")


def engine_kind(engine: object) -> str:
    """The transfer engine's kind as peers name it ("tcp", "nixl", ...): a subclass of an engine
    speaks its wire format."""
    return str(getattr(engine, "kind", type(engine).__name__))


def model_fingerprint(config: TinyConfig) -> str:
    """A short digest of everything that makes two models compute the same KV."""
    text = repr(sorted(attrs.asdict(config).items()))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def profile(layout: KVLayout, engine: object, model: TinyConfig) -> dict[str, Any]:
    """This node's side of the agreement, as plain JSON values."""
    return {
        "protocol": VERSION,
        "engine": engine_kind(engine),
        "page_size": layout.page_size,
        "layers": layout.layers,
        "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "model": model_fingerprint(model),
    }


def mismatch(mine: dict[str, Any], theirs: object, peer: str) -> str | None:
    """Why a peer's profile cannot work with this node's (None when it can)."""
    if not isinstance(theirs, dict):
        return f"{peer} sent no node profile (an older or foreign node): expected {', '.join(FIELDS)}"
    for name in FIELDS:
        if theirs.get(name) != mine[name]:
            return f"{name} differs: {mine[name]!r} here, {theirs.get(name)!r} at {peer}"
    return None
