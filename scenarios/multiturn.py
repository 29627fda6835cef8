"""A generated multi-turn chat workload: the default demo workload, with no trace needed.

Each conversation starts with a system prompt shared by all conversations, then alternates
user turns and model outputs; every turn's prompt is the whole conversation so far, which is
what makes decode-side prefix caching pay off.
"""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen(slots=True)
class ChatRequest:
    """One turn: its prompt is the conversation so far, its output follows it."""

    conversation: int
    turn: int
    arrival: float  # seconds from the start of the workload
    prompt: np.ndarray = attrs.field(eq=False)  # int32 token ids
    output: np.ndarray = attrs.field(eq=False)  # int32 token ids


@attrs.frozen(slots=True)
class MultiTurnChat:
    """Parameters of the generator; `generate` is deterministic in them (seeded PCG64)."""

    conversations: int = 200
    turns: int = 5
    system_prompt: int = 2048
    user_tokens: tuple[int, int] = (64, 1024)  # uniform range per turn
    output_tokens: tuple[int, int] = (64, 512)
    rate: float = 4.0  # new conversations per second (Poisson)
    think_time: float = 20.0  # mean seconds between a turn's arrival and the next (exponential)
    vocab: int = 32000
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("conversations", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"multi-turn workload: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("user_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"multi-turn workload: {name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if self.system_prompt < 0 or self.rate <= 0 or self.think_time < 0 or self.vocab < 2:
            raise ValueError("multi-turn workload: system_prompt >= 0, rate > 0, think_time >= 0, vocab >= 2")

    def generate(self) -> list[ChatRequest]:
        """All turns of all conversations, sorted by arrival time (ties by conversation, turn)."""
        rng = np.random.Generator(np.random.PCG64(self.seed))
        system = rng.integers(0, self.vocab, self.system_prompt, dtype=np.int32)
        starts = np.cumsum(rng.exponential(1.0 / self.rate, self.conversations))
        out: list[ChatRequest] = []
        for c in range(self.conversations):
            history = system
            t = float(starts[c])
            for turn in range(self.turns):
                user = rng.integers(
                    0, self.vocab, rng.integers(*self.user_tokens, endpoint=True), dtype=np.int32
                )
                prompt = np.concatenate([history, user])
                n_out = int(rng.integers(*self.output_tokens, endpoint=True))
                output = rng.integers(0, self.vocab, n_out, dtype=np.int32)
                out.append(ChatRequest(c, turn, t, prompt, output))
                history = np.concatenate([prompt, output])
                t += float(rng.exponential(self.think_time))
        out.sort(key=lambda r: (r.arrival, r.conversation, r.turn))
        return out
