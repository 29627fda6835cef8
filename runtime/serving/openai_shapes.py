"""OpenAI's response objects for one request and its choices: the whole answer, the stream's
chunks (each choice's own, by `index`, interleaved as their tokens come), and usage summed as
OpenAI sums it (each prompt once, every choice's completion)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import attrs
import trio

from hicache.runtime.serving.context import Context, Piece, Stream, interleave
from hicache.runtime.serving.errors import dumps
from hicache.runtime.serving.generation import Generation, Job
from hicache.runtime.serving.logprob_shapes import CompletionLogprobs, TokenTexts, chat_content
from hicache.runtime.serving.sse import DONE, EventStream, event


@attrs.frozen
class Plan:
    """A checked request: its choices' jobs in `index` order, the text each choice's answer
    starts with (`echo`), which choices count their prompt in usage (the first of each prompt)."""

    chat: bool
    jobs: list[Job]
    echoes: list[str]
    counts_prompt: list[bool]
    streaming: bool
    usage: bool
    logprobs: bool
    usage_every_chunk: bool = False  # vLLM's continuous_usage_stats: each chunk's usage so far


def finish_reason(gen: Generation) -> str | None:
    return None if gen.finish is None else gen.finish.reason


@attrs.define
class _Choice:
    index: int
    gen: Generation
    echo: str
    legacy: CompletionLogprobs | None  # completions with logprobs: its running text offset
    sent: int = 0  # output tokens whose logprobs a chunk carried
    echo_due: bool = True  # its echo (with the prompt's log-probabilities, if asked) not yet sent

    @property
    def scored(self) -> bool:
        """Whether its log-probabilities start with the prompt's (`echo` with `logprobs`)."""
        return self.legacy is not None and self.gen.job.input_logprobs_from >= 0


class Shapes:
    """OpenAI's objects for one request: the whole answer, its stream chunks and usage."""

    def __init__(self, ctx: Context, plan: Plan, gens: Sequence[Generation]) -> None:
        self.plan = plan
        self.chat = plan.chat
        self.texts = TokenTexts(ctx.codec)
        legacy = plan.logprobs and not plan.chat
        self.choices = [
            _Choice(i, gen, echo, CompletionLogprobs(self.texts, len(echo)) if legacy else None)
            for i, (gen, echo) in enumerate(zip(gens, plan.echoes, strict=True))
        ]
        self.id = ("chatcmpl-" if plan.chat else "cmpl-") + gens[0].rid
        self.created = int(time.time())
        self.model = ctx.model_name

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, c: _Choice) -> dict[str, Any] | None:
        """The log-probabilities of the choice's tokens no chunk carried yet (all, unstreamed)."""
        if not self.plan.logprobs:
            return None
        ids, lps = c.gen.output_ids[c.sent :], c.gen.logprobs[c.sent :]
        c.sent = len(c.gen.output_ids)
        if c.legacy is not None:
            out = c.legacy.take(ids, lps)
            if c.scored and c.echo_due:  # the whole answer: the prompt's first
                prompt = self._prompt_logprobs(c)
                out = {key: prompt[key] + out[key] for key in out}
            return out
        return {"content": chat_content(self.texts, ids, lps), "refusal": None}

    def _prompt_logprobs(self, c: _Choice) -> dict[str, Any]:
        """The echoed prompt's log-probabilities (`echo` with `logprobs`), once."""
        assert c.legacy is not None
        c.echo_due = False
        return c.legacy.take(c.gen.job.request.input_ids, c.gen.prompt_scores(), prompt=True)

    def whole(self) -> dict[str, Any]:
        out = []
        for c in self.choices:
            text = c.echo + c.gen.text
            if self.chat:
                choice: dict[str, Any] = {"index": c.index, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": c.index, "text": text}
            out.append(choice | {"logprobs": self._logprobs(c), "finish_reason": finish_reason(c.gen)})
        head = self._head("chat.completion" if self.chat else "text_completion")
        return head | {"choices": out, "usage": self.usage()}

    def chunk(
        self,
        c: _Choice,
        piece: str | None,
        finish: str | None = None,
        *,
        role: bool = False,
        echo: bool = False,
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if piece:
                delta["content"] = piece
            choice: dict[str, Any] = {"index": c.index, "delta": delta}
        else:
            choice = {"index": c.index, "text": piece or ""}
        logprobs = None
        if echo:  # the echo's chunk: the prompt's log-probabilities where asked for, no output's
            c.echo_due = False
            logprobs = self._prompt_logprobs(c) if c.scored else None
        elif not role and self.plan.logprobs and (c.gen.output_ids[c.sent :] or finish is not None):
            logprobs = self._logprobs(c)
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        out = self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [choice]}
        if self.plan.usage:
            out["usage"] = self.usage() if self.plan.usage_every_chunk else None
        return out

    def usage(self) -> dict[str, object]:
        """OpenAI's usage: each prompt once, every choice's completion; cached_tokens counts every
        tier (of each prompt's first choice)."""
        firsts = [c.gen for c, counts in zip(self.choices, self.plan.counts_prompt, strict=True) if counts]
        prompt = sum(g.prompt_tokens for g in firsts)
        completion = sum(len(c.gen.output_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(sum(g.cached.values()) for g in firsts)},
        }

    def usage_chunk(self) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return head | {"choices": [], "usage": self.usage()}

    def event_stream(self, streams: Sequence[Stream], stall_s: float | None = None) -> EventStream:
        """The response streaming every choice: one task per choice feeds its pieces to the body.
        With `stall_s`, a client that reads nothing for that long ends every choice (sse.py)."""
        receive, producers = interleave(streams)
        return EventStream(self._body(receive), producers, stall_s=stall_s, on_stall=self._abort_all)

    def _abort_all(self, reason: str) -> None:
        for c in self.choices:
            c.gen.abort(reason)

    async def _body(self, receive: trio.MemoryReceiveChannel[Piece]) -> AsyncGenerator[bytes]:
        async with receive:
            for c in self.choices:
                if self.chat:
                    yield event(self.chunk(c, None, role=True))
                elif c.echo and not c.scored:  # else once the prompt's log-probabilities are here
                    yield event(self.chunk(c, c.echo, echo=True))
            left = len(self.choices)
            async for i, piece in receive:
                c = self.choices[i]
                if c.scored and c.echo_due and not c.gen.failed:  # they came with the first token
                    yield event(self.chunk(c, c.echo, echo=True))
                if piece is None:  # the choice ended
                    if c.gen.failed:  # OpenAI's clients raise on an `error` object in a stream
                        yield b"data: " + dumps(c.gen.error().body()).encode("ascii") + b"\n\n"
                        yield DONE
                        return
                    yield event(self.chunk(c, None, finish_reason(c.gen)))
                    left -= 1
                    if not left:
                        break
                elif piece or (self.plan.logprobs and c.gen.output_ids[c.sent :]):
                    yield event(self.chunk(c, piece))
            if self.plan.usage:
                yield event(self.usage_chunk())
            yield DONE
