"""Test doubles for the HTTP front door (runtime/serving/): a byte-level codec and an
in-process backend. Never used outside tests."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

import attrs
import trio

from hicache.runtime.serving.backend import (
    TIERS,
    Finished,
    GenerateEvent,
    GenerateRequest,
    ModelInfo,
    Tokens,
)

EOS = 256
VOCAB = 260  # bytes 0..255, then EOS and three more special ids


class ByteCodec:
    """One token per UTF-8 byte; ids >= 256 are special and decode to nothing. A chat prompt is
    "<role>content\\n" per message and "<assistant>" to finish, byte for byte."""

    max_token_chars = 1  # a token is one byte, so at most one character

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    chat_features: frozenset[str] = frozenset()  # renders roles and contents only

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if messages[-1]["role"] == "tool" and len(messages) == 1:
            raise ValueError("a conversation cannot open with a tool message")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


# A chat template in the manner of Qwen2.5's: tools in the system turn, tool calls as JSON.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "({{ c.function.arguments }})</call>{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class ToolCodec(ByteCodec):
    """A ByteCodec whose chat template renders tools and tool calls, through the real renderer."""

    def __init__(self) -> None:
        from hicache.runtime.model.chat_template import template_features

        self.chat_features = template_features(TOOL_TEMPLATE)

    def apply_chat_template(  # type: ignore[override]
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: Any = None
    ) -> str:
        from hicache.runtime.model.chat_template import render_chat

        return render_chat(TOOL_TEMPLATE, messages, add_generation_prompt=add_generation_prompt, tools=tools)


def fake_logprob(token: int, top: int) -> list[Any]:
    """What FakeBackend reports for `token`: log-probability -0.25, then `top` alternatives."""
    alternatives = [[token, -0.25]] + [[(token + k) % 256, -1.0 - k] for k in range(1, top)]
    return [-0.25, alternatives[:top]]


@attrs.define
class FakeBackend:
    """Answers each prompt with its own tokens, cycled (so the output text is the prompt's
        text again), `delay_s` apart. EOS after `eos_after` tokens unless ignore_eos. Cached
        tokens: the longest prefix shared with an earlier prompt, all of it "l1" (cleared by
        flush). `refuse`: answer every request with Finished("abort", refuse), or, with
        `refuse_as_is`, as a node refusing the request as it is (Finished("error", refuse,
        refused=True)); `fail_after`: raise
    RuntimeError after that many tokens (a backend bug). Records what it
        saw: `requests`, `aborted` and `finished` rids, and `active` ones."""

    max_context: int = 4096
    delay_s: float = 0.0
    eos_after: int | None = None
    refuse: str | None = None
    refuse_as_is: bool = False
    fail_after: int | None = None
    stats_value: dict[str, float] = attrs.field(
        factory=lambda: {"queue_waiting": 0.0, "pool_l1_used_pages": 3.0}
    )
    requests: list[GenerateRequest] = attrs.field(factory=list)
    aborted: list[str] = attrs.field(factory=list)
    finished: list[str] = attrs.field(factory=list)
    active: set[str] = attrs.field(factory=set)
    flushes: int = 0
    _seen: list[list[int]] = attrs.field(factory=list)

    def model_info(self) -> ModelInfo:
        return ModelInfo("fake/byte-echo", self.max_context, (EOS,), VOCAB)

    async def flush(self) -> None:
        self.flushes += 1
        self._seen.clear()

    async def stats(self) -> dict[str, float]:
        return dict(self.stats_value, requests_active=float(len(self.active)))

    def _cached(self, ids: list[int]) -> int:
        best = 0
        for old in self._seen:
            n = 0
            for a, b in zip(old, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        self.requests.append(req)
        self.active.add(req.rid)
        done = False
        try:
            cached = dict.fromkeys(TIERS, 0)
            cached["l1"] = self._cached(req.input_ids)
            self._seen.append(list(req.input_ids))
            if self.refuse is not None:
                done = True
                reason = "error" if self.refuse_as_is else "abort"
                yield Finished(reason, self.refuse, len(req.input_ids), cached, refused=self.refuse_as_is)
                return
            for n in range(req.max_new_tokens):
                await trio.sleep(self.delay_s)
                if n == self.fail_after:
                    raise RuntimeError("the fake broke")
                if self.eos_after is not None and n == self.eos_after and not req.sampling.ignore_eos:
                    yield Tokens([EOS])
                    done = True
                    yield Finished("stop", "", len(req.input_ids), cached, 0.0)
                    return
                token = req.input_ids[n % len(req.input_ids)]
                if token in req.sampling.stop_token_ids:
                    yield Tokens([token])
                    done = True
                    yield Finished("stop", "", len(req.input_ids), cached, 0.0)
                    return
                # The tier account rides on the first token, so a request the front door
                # ends early (a stop string) still reports its hits.
                sampling = req.sampling
                lps = [fake_logprob(token, sampling.top_logprobs)] if sampling.logprobs else None
                yield Tokens([token], cached if n == 0 else None, logprobs=lps)
            done = True
            yield Finished("length", "", len(req.input_ids), cached, 0.0)
        finally:
            self.active.discard(req.rid)
            (self.finished if done else self.aborted).append(req.rid)
