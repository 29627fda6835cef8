"""Concurrent chat traffic for the digital twin's real-node tests (tests/test_twin_real.py): `workers`
client threads of the `openai` package take sessions from a queue, each session a chat that
shares one system prompt with every other, with questions of mixed lengths (some prompts shorter
than Mooncake's 512-token block), and every third session abandoned after its first turn. A
session is carried as OpenAI's `user`, which the front door records as the session.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

SYSTEM = "You are a concise assistant for a hardware shop. Answer in one short sentence."
ASKS = [
    "Do you sell drills?",
    "I need a ladder that reaches a second-floor gutter, light enough to carry alone, and stable on "
    "soft ground; which would you suggest and why?",
    "Price of nails?",
    "What glue holds wood to metal outdoors through a wet winter without going brittle?",
]


def session_turns(s: int, turns: int) -> list[str]:
    """The questions of session `s`: mixed lengths, the session's own number in the first."""
    return [f"(customer {s}) " + ASKS[(s + k) % len(ASKS)] for k in range(turns)]


def play(url: str, model: str, *, workers: int, sessions: int, turns: int, max_tokens: int) -> list[str]:
    """Run the traffic; returns the errors the workers met (none expected)."""
    import openai

    todo: queue.Queue[int] = queue.Queue()
    for s in range(sessions):
        todo.put(s)
    errors: list[str] = []

    def worker() -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        while True:
            try:
                s = todo.get_nowait()
            except queue.Empty:
                return
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
            n = 1 if s % 3 == 2 else turns  # abandoned after its first turn
            for ask in session_turns(s, n):
                messages.append({"role": "user", "content": ask})
                try:
                    out = client.chat.completions.create(
                        model=model, messages=messages, max_tokens=max_tokens, temperature=0, user=f"s{s}"
                    )
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    errors.append(f"session {s}: {type(exc).__name__}: {exc}")
                    return
                messages.append({"role": "assistant", "content": out.choices[0].message.content or ""})

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
