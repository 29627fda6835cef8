"""Choosing the next token from logits: greedy, or sampled with temperature, top-k, top-p, min-p.

Sampling is deterministic per `(seed, position)`: each row draws its one uniform number from a
generator seeded by a hash of the request's seed and the token's position, never from a shared
stream. So a request gets the same tokens whichever batch it lands in, whatever its neighbours
ask for, and after a restart or a retraction that recomputes it (given the same logits).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import torch

MIN_TEMPERATURE = 1e-6  # below it, logits / temperature overflows: drawn greedily, as SGLang does


class Knobs(Protocol):
    """How one request picks its tokens: a checked `Sampling` (`runtime/wire/sampling_fields.py`,
    which holds the limits; this package imports no other, so it names the fields it reads).

    `temperature` 0 is greedy (the lowest index among equal maxima); `top_k` 0 and `top_p` 1 and
    `min_p` 0 are off. `seed` None means "derived from the request": `sample` then uses the
    request's key, so the caller must pass `request_keys`.
    """

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def seed(self) -> int | None: ...


def is_greedy(params: Knobs) -> bool:
    """Whether `params` picks the top token: temperature 0 (or too small to divide by), top_k 1."""
    return params.temperature < MIN_TEMPERATURE or params.top_k == 1


def _uniform(seed: int | str, position: int) -> float:
    """One number in [0, 1) that depends on `(seed, position)` only."""
    digest = hashlib.blake2b(f"{seed!r}:{position}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def _sample_row(logits: torch.Tensor, params: Knobs, u: float) -> int:
    scaled = logits.to(torch.float64) / params.temperature
    # Descending, ties by lowest index: the order every filter and the draw walk.
    order = torch.sort(-scaled, stable=True).indices
    ranked = scaled[order]
    if params.top_k:
        ranked, order = ranked[: params.top_k], order[: params.top_k]
    probs = torch.softmax(ranked, dim=0)
    keep = probs.shape[0]
    if params.top_p < 1.0:
        before = torch.cumsum(probs, dim=0) - probs  # mass ranked strictly above each token
        keep = min(keep, int((before < params.top_p).sum()))
    if params.min_p > 0.0:
        keep = min(keep, int((probs >= params.min_p * probs[0]).sum()))
    keep = max(keep, 1)
    cumulative = torch.cumsum(probs[:keep], dim=0)
    target = torch.tensor([u * float(cumulative[-1])], dtype=torch.float64)
    index = min(int(torch.searchsorted(cumulative, target, right=True)), keep - 1)
    return int(order[index])


def sample(
    logits: torch.Tensor,
    params: Sequence[Knobs],
    positions: Sequence[int],
    request_keys: Sequence[int | str] | None = None,
) -> list[int]:
    """The next token of each row of `logits` `(B, vocab)`.

    Row b follows `params[b]`; `positions[b]` is the position the chosen token will take (so
    each step of a request draws a fresh number). A row whose `seed` is None draws from
    `request_keys[b]` instead (a request id, say).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: expected a (batch, vocab) tensor, got {got}")
    batch = logits.shape[0]
    if len(params) != batch or len(positions) != batch:
        raise ValueError(
            f"params and positions: expected {batch} each (one per row of logits), got {len(params)} and "
            f"{len(positions)}"
        )
    if request_keys is not None and len(request_keys) != batch:
        raise ValueError(f"request_keys: expected {batch} (one per row of logits), got {len(request_keys)}")
    if torch.isnan(logits).any():
        raise ValueError(f"logits: row {int(torch.isnan(logits).any(dim=1).nonzero()[0])} holds NaN")
    greedy = logits.argmax(dim=1).tolist()
    out = []
    for b, p in enumerate(params):
        if is_greedy(p):
            out.append(int(greedy[b]))
            continue
        seed = p.seed if p.seed is not None else (request_keys[b] if request_keys is not None else None)
        if seed is None:
            raise ValueError(f"params[{b}]: seed is None and no request_keys were given to derive it from")
        out.append(_sample_row(logits[b], p, _uniform(seed, int(positions[b]))))
    return out
