"""The `sampling` field of a `generate` message, checked like every other field a client sends.

A client asks for greedy decoding (the default: `temperature` 0), or for sampling with
`temperature`, `top_p`, `top_k` and a `seed`; `stop_token_ids` end the request early, and
`ignore_eos` keeps the model's own end-of-sequence tokens from doing so. The checked dict goes to
the prefill node with the request (it samples the first token) and drives every later token
on the decode node, so both sides draw the same way.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from hicache.runtime.model.sampling import SamplingParams, sample
from hicache.runtime.wire.protocol import MessageError, show

MAX_STOP_TOKENS = 64
DEFAULTS: dict[str, Any] = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "seed": None,
    "stop_token_ids": (),
    "ignore_eos": False,
}


def _bad(name: str, expected: str, value: object) -> MessageError:
    return MessageError(f"message 'generate': field 'sampling.{name}' must be {expected}, got {show(value)}")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_sampling(raw: object, vocab: int) -> dict[str, Any]:
    """The sampling parameters in `raw` (None: all defaults), or a `MessageError` naming the
    first bad one."""
    if raw is None:
        return dict(DEFAULTS)
    if not isinstance(raw, dict):
        raise MessageError(f"message 'generate': field 'sampling' must be an object, got {show(raw)}")
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise MessageError(
            f"message 'generate': field 'sampling' has unknown key {show(unknown[0])}; "
            f"expected some of {', '.join(DEFAULTS)}"
        )
    out = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    t = out["temperature"]
    if not _number(t) or not 0 <= t <= 100:
        raise _bad("temperature", "a number in 0..100 (0: greedy)", t)
    p = out["top_p"]
    if not _number(p) or not 0 < p <= 1:
        raise _bad("top_p", "a number in (0, 1]", p)
    k = out["top_k"]
    if type(k) is not int or not 0 <= k <= vocab:
        raise _bad("top_k", f"an integer in 0..{vocab} (0: no limit)", k)
    seed = out["seed"]
    if seed is not None and (type(seed) is not int or not 0 <= seed < 1 << 63):
        raise _bad("seed", "an integer in 0..2**63-1", seed)
    stops = out["stop_token_ids"]
    if (
        not isinstance(stops, list | tuple)
        or len(stops) > MAX_STOP_TOKENS
        or not all(type(t) is int and 0 <= t < vocab for t in stops)
    ):
        expected = f"a list of at most {MAX_STOP_TOKENS} token ids in 0..{vocab - 1}"
        raise _bad("stop_token_ids", expected, stops)
    if not isinstance(out["ignore_eos"], bool):
        raise _bad("ignore_eos", "true or false", out["ignore_eos"])
    out["temperature"], out["top_p"] = float(t), float(p)
    out["stop_token_ids"] = list(stops)
    return out


def seed_for(rid: str) -> int:
    """A request's sampling seed when the client gives none: fixed by its id, so the prefill
    node (first token) and the decode node (the rest) draw from one stream."""
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "replace"), digest_size=8).digest()) >> 1


def draw(logits: torch.Tensor, sampling: Sequence[dict[str, Any]], positions: Sequence[int]) -> list[int]:
    """The next token of each row of `logits` (B, vocab) under its request's `check_sampling`
    dict (`runtime/model/sampling.py`: the same token whatever batch the request is in, and
    whichever node draws it). A dict without a seed draws from seed 0."""
    params = [
        SamplingParams(temperature=p["temperature"], top_p=p["top_p"], top_k=p["top_k"], seed=p["seed"] or 0)
        for p in sampling
    ]
    return sample(logits, params, positions)
