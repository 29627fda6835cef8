"""Generated workloads beside the multi-turn chat: agent tool loops and shared system prompts.

Both are deterministic in their parameters (seeded PCG64) and return `ChatRequest`s, so they
replay through `workload.from_chat` like `MultiTurnChat`:

- `AgenticLoop`: an agent calls tools in a loop. Every step's prompt is the whole session so
  far, so consecutive steps share almost everything; outputs are short (tool calls) and tool
  results can be long, which makes the increment per step small next to the prefix.
- `SharedPrefix`: groups of independent prompts that share only a group's system prompt (the
  `generated-shared-prefix` benchmark shape): the hit is one fixed-size prefix per group.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from hicache.scenarios.multiturn import ChatRequest

VOCAB_MAX = 1 << 31  # token ids are int32


def _check_int(where: str, name: str, value: object, low: int, high: int | None = None) -> None:
    integer = isinstance(value, int) and not isinstance(value, bool)
    if not integer or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{where}: {name} must be an integer {span}, got {value!r}")


def _check_range(where: str, name: str, value: object) -> None:
    ok = (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 1 <= value[0] <= value[1]
    )
    if not ok:
        raise ValueError(f"{where}: {name} must be a range (lo, hi) of integers 1 <= lo <= hi, got {value!r}")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def _check_number(where: str, name: str, value: object, low: float, *, strict: bool) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool) and _finite(value)
    if not number or (value <= low if strict else value < low):
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(f"{where}: {name} must be a finite number {bound}, got {value!r}")


def _tokens(rng: np.random.Generator, vocab: int, span: tuple[int, int]) -> np.ndarray:
    """A run of random token ids whose length is uniform in the inclusive `span`."""
    return rng.integers(0, vocab, int(rng.integers(span[0], span[1], endpoint=True)), dtype=np.int32)


@attrs.frozen(slots=True)
class AgenticLoop:
    """Agent sessions: a system prompt (with tool definitions) shared by every session, a task per
    session, then `steps` model calls; each call's prompt is the previous prompt + the previous
    output (a tool call) + the tool's result. The gap between calls is the tool's run time."""

    sessions: int = 50
    steps: int = 10
    system_prompt: int = 4096
    task_tokens: tuple[int, int] = (256, 2048)
    tool_output_tokens: tuple[int, int] = (128, 4096)
    output_tokens: tuple[int, int] = (32, 256)
    rate: float = 1.0  # new sessions per second (Poisson)
    tool_time: float = 2.0  # mean seconds between a step's arrival and the next (exponential)
    vocab: int = 32000
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        where = "agentic workload"
        _check_int(where, "sessions", self.sessions, 1)
        _check_int(where, "steps", self.steps, 1)
        _check_int(where, "system_prompt", self.system_prompt, 0)
        for name in ("task_tokens", "tool_output_tokens", "output_tokens"):
            _check_range(where, name, getattr(self, name))
        _check_number(where, "rate", self.rate, 0, strict=True)
        _check_number(where, "tool_time", self.tool_time, 0, strict=False)
        _check_int(where, "vocab", self.vocab, 2, VOCAB_MAX)
        _check_int(where, "seed", self.seed, 0)

    def generate(self) -> list[ChatRequest]:
        """Every step of every session, sorted by (arrival, session, step)."""
        rng = np.random.Generator(np.random.PCG64(self.seed))
        system = rng.integers(0, self.vocab, self.system_prompt, dtype=np.int32)
        starts = np.cumsum(rng.exponential(1.0 / self.rate, self.sessions))
        out: list[ChatRequest] = []
        for s in range(self.sessions):
            prompt = np.concatenate([system, _tokens(rng, self.vocab, self.task_tokens)])
            t = float(starts[s])
            for step in range(self.steps):
                output = _tokens(rng, self.vocab, self.output_tokens)
                out.append(ChatRequest(s, step, t, prompt, output))
                if step + 1 < self.steps:
                    result = _tokens(rng, self.vocab, self.tool_output_tokens)
                    prompt = np.concatenate([prompt, output, result])
                    t += float(rng.exponential(self.tool_time))
        out.sort(key=lambda r: (r.arrival, r.conversation, r.turn))
        return out


@attrs.frozen(slots=True)
class SharedPrefix:
    """`groups` x `prompts_per_group` single-turn prompts; the prompts of a group share its system
    prompt and nothing else. Arrivals are Poisson and the groups randomly interleaved, so a
    group's prompts are spread over the run. `conversation` is the group, `turn` the prompt's
    index within it."""

    groups: int = 64
    prompts_per_group: int = 16
    system_prompt: int = 2048
    question_tokens: tuple[int, int] = (64, 256)
    output_tokens: tuple[int, int] = (64, 512)
    rate: float = 8.0  # requests per second (Poisson)
    vocab: int = 32000
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        where = "shared-prefix workload"
        _check_int(where, "groups", self.groups, 1)
        _check_int(where, "prompts_per_group", self.prompts_per_group, 1)
        _check_int(where, "system_prompt", self.system_prompt, 0)
        for name in ("question_tokens", "output_tokens"):
            _check_range(where, name, getattr(self, name))
        _check_number(where, "rate", self.rate, 0, strict=True)
        _check_int(where, "vocab", self.vocab, 2, VOCAB_MAX)
        _check_int(where, "seed", self.seed, 0)

    def generate(self) -> list[ChatRequest]:
        """Every prompt of every group, sorted by (arrival, group, index in group)."""
        rng = np.random.Generator(np.random.PCG64(self.seed))
        systems = [
            rng.integers(0, self.vocab, self.system_prompt, dtype=np.int32) for _ in range(self.groups)
        ]
        order = rng.permutation(np.repeat(np.arange(self.groups), self.prompts_per_group))
        arrivals = np.cumsum(rng.exponential(1.0 / self.rate, len(order)))
        seen = [0] * self.groups
        out: list[ChatRequest] = []
        for g, t in zip(order.tolist(), arrivals.tolist(), strict=True):
            prompt = np.concatenate([systems[g], _tokens(rng, self.vocab, self.question_tokens)])
            output = _tokens(rng, self.vocab, self.output_tokens)
            out.append(ChatRequest(g, seen[g], t, prompt, output))
            seen[g] += 1
        out.sort(key=lambda r: (r.arrival, r.conversation, r.turn))
        return out
