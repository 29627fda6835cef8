"""How one request picks its tokens: the one definition of the sampling fields and their limits.

The front door builds a `Sampling` from an HTTP body (a refusal there is a 400 naming the
client's key), the decode node from a `generate` message and the prefill node from a `kv`
message (`from_wire`: a refusal ends that request with the reason, never the node), and the
sampler (`runtime/model/sampling.py`) draws with it. One set of limits, so a value the node
would refuse never gets past the front door.

A client asks for greedy decoding (`temperature` 0, the default here), or for sampling with
`temperature`, `top_p`, `top_k`, `min_p` and a `seed`; `stop_token_ids` end the request early,
and `ignore_eos` keeps the model's own end-of-sequence tokens from doing so. The logits are
adjusted first by `repetition_penalty` (SGLang's and Hugging Face's: over prompt and output),
`frequency_penalty` and `presence_penalty` (OpenAI's: over the output) and `logit_bias`.
`logprobs` asks for each chosen token's log-probability and `top_logprobs` for that many of
the most likely alternatives; `prompt_logprobs_from` asks for the same of the prompt's tokens
from that position on (SGLang's `logprob_start_len`, OpenAI's `echo` from 0). No torch here:
the front door imports this module and runs without it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.runtime.wire.protocol import MessageError, show

MAX_TEMPERATURE = 100.0  # far past where every token is equally likely
MAX_TOP_K = 2**31 - 1
MAX_STOP_TOKEN_IDS = 256
SEED_RANGE = (-(2**63), 2**64 - 1)  # a 64-bit integer, signed or unsigned (JSON clients send both)
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's (and SGLang's) for frequency_penalty and presence_penalty
MAX_REPETITION_PENALTY = 2.0  # SGLang's; 1 is off, below 1 favours repeats
MAX_LOGIT_BIAS = 100.0  # OpenAI's: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit


class SamplingError(ValueError):
    """A sampling field outside its limits: which field, what it must be, and what came."""

    def __init__(self, field: str, expected: str, value: object) -> None:
        self.field, self.expected, self.value = field, expected, value
        super().__init__(f"'{field}' must be {expected}, not {show(value)}")


def _as_float(value: object) -> object:
    """A number as a float; anything else (a bool, a string, an int past float) as it came, for
    the check to refuse by name."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


def _as_int(value: object) -> object:
    """An integral float (100.0, as some JSON encoders write integers) as an int."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def _as_top_k(value: object) -> object:
    """SGLang's -1 and the 0 of others both mean "no limit": stored as 0."""
    value = _as_int(value)
    return 0 if type(value) is int and value == -1 else value


def _as_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list | tuple) else value


def _as_bias(value: object) -> object:
    """`logit_bias` as sorted (token id, bias) pairs: OpenAI's object of id strings, or the
    pairs the wire carries; anything else as it came, for the check to refuse by name."""
    if isinstance(value, Mapping):
        pairs = []
        for key, bias in value.items():
            token: object = key
            if isinstance(key, str) and key.strip().lstrip("-").isdigit():
                token = int(key)
            pairs.append((token, _as_float(bias)))
        value = pairs
    if isinstance(value, list | tuple) and all(isinstance(p, list | tuple) and len(p) == 2 for p in value):
        pairs = [(_as_int(t), _as_float(b)) for t, b in value]
        if all(_is_int(t) for t, _ in pairs):
            return tuple(sorted(pairs))
        return tuple(pairs)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen(kw_only=True)
class Sampling:
    """One request's sampling, checked when made: every instance is within the limits above.

    `temperature` 0 is greedy; `top_k` 0, `top_p` 1 and `min_p` 0 are off. `seed` None means
    "derived from the request": the decode node fills it in (`seed_for`) before anything draws.
    """

    temperature: float = attrs.field(default=0.0, converter=_as_float)
    top_p: float = attrs.field(default=1.0, converter=_as_float)
    top_k: int = attrs.field(default=0, converter=_as_top_k)
    min_p: float = attrs.field(default=0.0, converter=_as_float)
    seed: int | None = attrs.field(default=None, converter=_as_int)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)
    ignore_eos: bool = False
    presence_penalty: float = attrs.field(default=0.0, converter=_as_float)
    frequency_penalty: float = attrs.field(default=0.0, converter=_as_float)
    repetition_penalty: float = attrs.field(default=1.0, converter=_as_float)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_bias)
    logprobs: bool = False
    top_logprobs: int = attrs.field(default=0, converter=_as_int)
    # -1: none. Else the prompt's tokens from this position on, as SGLang gives them: the first
    # has none (it is where the scoring starts), each later one its log-probability given the
    # tokens before it, with `top_logprobs` alternatives.
    prompt_logprobs_from: int = attrs.field(default=-1, converter=_as_int)

    @property
    def penalized(self) -> bool:
        """Whether the logits are adjusted before the draw (a penalty or a bias is set)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def __attrs_post_init__(self) -> None:
        self.check()

    def check(self, vocab: int | None = None) -> Sampling:
        """This value, or a `SamplingError` naming the first field outside its limits; with
        `vocab`, stop token ids must also be tokens of that vocabulary."""
        t, p, k, m, seed = self.temperature, self.top_p, self.top_k, self.min_p, self.seed
        if type(t) is not float or not 0.0 <= t <= MAX_TEMPERATURE:  # NaN fails both
            raise SamplingError("temperature", f"a number in [0, {MAX_TEMPERATURE:g}] (0: greedy)", t)
        if type(p) is not float or not 0.0 < p <= 1.0:
            raise SamplingError("top_p", "a number in (0, 1]", p)
        if not _is_int(k) or not 0 <= k <= MAX_TOP_K:
            raise SamplingError("top_k", f"an integer in -1..{MAX_TOP_K} (0 or -1: no limit)", k)
        if type(m) is not float or not 0.0 <= m < 1.0:
            raise SamplingError("min_p", "a number in [0, 1) (0: off)", m)
        if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
            raise SamplingError("seed", "an integer in -2**63..2**64-1", seed)
        stops = self.stop_token_ids
        top = math.inf if vocab is None else vocab
        if (
            not isinstance(stops, tuple)
            or len(stops) > MAX_STOP_TOKEN_IDS
            or not all(_is_int(s) and 0 <= s < top for s in stops)
        ):
            ids = "token ids" if vocab is None else f"token ids in [0, {vocab})"
            raise SamplingError("stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} {ids}", stops)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError("ignore_eos", "true or false", self.ignore_eos)
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if type(value) is not float or not lo <= value <= hi:
                raise SamplingError(name, f"a number in [{lo:g}, {hi:g}] (0: off)", value)
        r = self.repetition_penalty
        if type(r) is not float or not 0.0 < r <= MAX_REPETITION_PENALTY:
            expected = f"a number in (0, {MAX_REPETITION_PENALTY:g}] (1: off)"
            raise SamplingError("repetition_penalty", expected, r)
        self._check_bias(top)
        if not isinstance(self.logprobs, bool):
            raise SamplingError("logprobs", "true or false", self.logprobs)
        n = self.top_logprobs
        if not _is_int(n) or not 0 <= n <= MAX_TOP_LOGPROBS:
            raise SamplingError("top_logprobs", f"an integer in 0..{MAX_TOP_LOGPROBS}", n)
        if n and not self.logprobs:
            raise SamplingError("top_logprobs", "0 unless logprobs is true", n)
        start = self.prompt_logprobs_from
        if not _is_int(start) or not -1 <= start < 2**31:
            raise SamplingError("prompt_logprobs_from", "an integer in -1..2**31-1 (-1: none)", start)
        if start >= 0 and not self.logprobs:
            raise SamplingError("prompt_logprobs_from", "-1 unless logprobs is true", start)
        return self

    def _check_bias(self, top: float) -> None:
        bias = self.logit_bias
        ids = "token ids" if math.isinf(top) else f"token ids in [0, {int(top)})"
        expected = (
            f"an object of at most {MAX_LOGIT_BIAS_TOKENS} {ids} to numbers in "
            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
        )
        if (
            not isinstance(bias, tuple)
            or len(bias) > MAX_LOGIT_BIAS_TOKENS
            or not all(
                _is_int(t) and 0 <= t < top and type(b) is float and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                for t, b in bias
            )
            or len({t for t, _ in bias}) != len(bias)
        ):
            raise SamplingError("logit_bias", expected, bias)

    @classmethod
    def parse(cls, fields: Mapping[str, Any], vocab: int) -> Sampling:
        """A `Sampling` from `fields` named as here (a missing or None field takes its default),
        checked against `vocab`; a `SamplingError` names the first bad one."""
        return cls(**{k: v for k, v in fields.items() if v is not None}).check(vocab)

    def to_wire(self) -> dict[str, Any]:
        """The `sampling` field of a node message (JSON)."""
        wire = attrs.asdict(self)
        wire["stop_token_ids"] = list(self.stop_token_ids)
        wire["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return wire

    @classmethod
    def from_wire(cls, raw: object, vocab: int, op: str = "generate") -> Sampling:
        """The `sampling` field of message `op` (None: every default), checked again, whoever
        sent it; a bad one is a `MessageError` (the request ends with it as the reason)."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise MessageError(f"message {op!r}: field 'sampling' must be an object, got {show(raw)}")
        unknown = sorted(map(str, set(raw) - set(FIELDS)))
        if unknown:
            raise MessageError(
                f"message {op!r}: field 'sampling' has unknown key {show(unknown[0])}; "
                f"expected some of {', '.join(FIELDS)}"
            )
        try:
            return cls.parse(raw, vocab)
        except SamplingError as exc:
            raise MessageError(
                f"message {op!r}: field 'sampling.{exc.field}' must be {exc.expected}, got {show(exc.value)}"
            ) from None


FIELDS = tuple(a.name for a in attrs.fields(Sampling))


def seed_for(rid: str) -> int:
    """A request's sampling seed when the client gives none: fixed by its id, so the prefill
    node (first token) and the decode node (the rest) draw from one stream."""
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "replace"), digest_size=8).digest()) >> 1
