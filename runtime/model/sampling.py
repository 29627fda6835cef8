"""Choosing the next token from logits: penalties and bias first (`adjust`), then greedy, or
sampled with temperature, top-k, top-p, min-p (`sample`); and the log-probabilities a client
asked for (`logprobs`), of the model's own distribution.

Sampling is deterministic per `(seed, position)`: each row draws its one uniform number from a
generator seeded by a hash of the request's seed and the token's position, never from a shared
stream. So a request gets the same tokens whichever batch it lands in, whatever its neighbours
ask for, and after a restart or a retraction that recomputes it (given the same logits).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Protocol

import torch

MIN_TEMPERATURE = 1e-6  # below it, logits / temperature overflows: drawn greedily, as SGLang does
FLOOR_LOGPROB = -9999.0  # what an impossible token's log-probability is reported as (JSON has no -inf)

# A chosen token's log-probability, and the most likely tokens' (id, log-probability), best first.
TokenLogprob = tuple[float, list[tuple[int, float]]]


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
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def penalized(self) -> bool: ...
    @property
    def logprobs(self) -> bool: ...
    @property
    def top_logprobs(self) -> int: ...


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
    target = torch.tensor([u * float(cumulative[-1])], dtype=torch.float64, device=cumulative.device)
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


def _counts(
    seqs: Sequence[Sequence[int]], vocab: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(len(seqs), vocab) on `device`: how often each token occurs in each sequence, in one scatter."""
    lengths = torch.tensor([len(q) for q in seqs], dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    out = torch.zeros((len(seqs), vocab), dtype=dtype, device=device)
    at = (rows.to(device), flat.to(device))
    return out.index_put_(at, torch.ones(flat.shape, dtype=dtype, device=device), accumulate=True)


def adjust(
    logits: torch.Tensor,
    params: Sequence[Knobs],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """`logits` `(B, vocab)` with each row's penalties and bias applied (the rows without any
    unchanged; `logits` itself untouched), batched over the rows that have one.

    In vLLM's order: `repetition_penalty` (Hugging Face's and SGLang's: a positive logit of a token
    seen in prompt or output divided by it, a negative one multiplied), then `frequency_penalty`
    times the token's count in the output and `presence_penalty` once if it occurs there (OpenAI's,
    subtracted), then `logit_bias` added.
    """
    rows = [b for b, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    vocab, dtype, dev = logits.shape[1], logits.dtype, logits.device
    index = torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = logits[index].clone()

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params[b], name) for b in rows], dtype=dtype, device=dev)[:, None]

    if any(params[b].repetition_penalty != 1.0 for b in rows):
        rep = column("repetition_penalty")
        seen = _counts([[*prompts[b], *outputs[b]] for b in rows], vocab, dtype, dev) > 0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    counts = _counts([outputs[b] for b in rows], vocab, dtype, dev)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0).to(dtype)
    pairs = [(r, t, bias) for r, b in enumerate(rows) for t, bias in params[b].logit_bias]
    if pairs:
        r, t, bias = zip(*pairs, strict=True)
        at = (torch.tensor(r, dtype=torch.int64, device=dev), torch.tensor(t, dtype=torch.int64, device=dev))
        sub.index_put_(at, torch.tensor(bias, dtype=dtype, device=dev), accumulate=True)
    out = logits.clone()
    out[index] = sub
    return out


def logprobs(
    logits: torch.Tensor, params: Sequence[Knobs], chosen: Sequence[int]
) -> list[TokenLogprob | None]:
    """For each row that asked (`logprobs`), the chosen token's log-probability and its
    `top_logprobs` most likely tokens (ties: the lower id first); None for the others.

    They are the model's own distribution, the log-softmax of its raw logits: before penalties,
    bias, temperature and the top-k/top-p/min-p filters (vLLM's default, `raw_logprobs`), so a
    token's figure does not depend on how it was drawn.
    """
    rows = [b for b, p in enumerate(params) if p.logprobs]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    dev = logits.device
    index = torch.tensor(rows, dtype=torch.int64, device=dev)
    lp = torch.log_softmax(logits[index].to(torch.float64), dim=1)
    lp = torch.nan_to_num(lp, neginf=FLOOR_LOGPROB)
    wanted = torch.tensor([chosen[b] for b in rows], dtype=torch.int64, device=dev)[:, None]
    picked = lp.gather(1, wanted)[:, 0].tolist()
    k = max(params[b].top_logprobs for b in rows)
    top_ids: list[list[int]] = [[] for _ in rows]
    top_lp: list[list[float]] = [[] for _ in rows]
    if k:
        order = torch.sort(-lp, dim=1, stable=True).indices[:, :k]
        top_ids, top_lp = order.tolist(), lp.gather(1, order).tolist()
    for r, b in enumerate(rows):
        n = params[b].top_logprobs
        out[b] = (picked[r], list(zip(top_ids[r][:n], top_lp[r][:n], strict=True)))
    return out


PROMPT_ROWS = 64  # rows of a prompt's logits turned into log-probabilities at once (float64)


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], params: Knobs) -> list[TokenLogprob]:
    """Row i's log-probability of `targets[i]` (the prompt token after row i's position) and its
    `top_logprobs` most likely tokens, as `logprobs` gives an output token's; a block of rows at
    a time, so a long prompt never holds its whole vocabulary-wide log-softmax at once."""
    if logits.shape[0] != len(targets):
        raise ValueError(f"prompt_logprobs: {logits.shape[0]} rows of logits for {len(targets)} tokens")
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), PROMPT_ROWS):
        hi = min(lo + PROMPT_ROWS, len(targets))
        block = logprobs(logits[lo:hi], [params] * (hi - lo), targets[lo:hi])
        out.extend(lp for lp in block if lp is not None)
    return out


def choose(
    logits: torch.Tensor,
    params: Sequence[Knobs],
    positions: Sequence[int],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    request_keys: Sequence[int | str] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The next token of each row (`adjust`, then `sample`) and its log-probabilities where
    asked for: what both nodes do with a step's logits."""
    tokens = sample(adjust(logits, params, prompts, outputs), params, positions, request_keys)
    return tokens, logprobs(logits, params, tokens)
