"""Log-probabilities in the shapes clients read them in: OpenAI chat's `logprobs.content`, the
legacy completions' parallel lists, SGLang's `[logprob, token id, text]` triples.

The nodes send, per output token, `[logprob, [[id, logprob], ...]]`: the chosen token's
log-probability under the model's own distribution and the most likely tokens', best first
(`runtime/model/sampling.py`). A token's text is the tokenizer's decoding of it alone, so a
token that holds part of a UTF-8 character shows as U+FFFD, as in vLLM and SGLang; `bytes`
gives the UTF-8 of that text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache.runtime.serving.backend import TextCodec

FLOOR = -9999.0  # a token whose figure never arrived (what vLLM reports for -inf)


def _parts(lp: Any) -> tuple[float, list[tuple[int, float]]]:
    if lp is None:
        return FLOOR, []
    return float(lp[0]), [(int(t), float(v)) for t, v in lp[1]]


class TokenTexts:
    """Each token id's text, decoded once per request."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self._seen: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._seen.get(token)
        if text is None:
            text = self._seen[token] = self.codec.decode([token])
        return text


def chat_content(texts: TokenTexts, ids: Sequence[int], lps: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI chat's `choices[].logprobs.content` for these tokens."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = texts(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    out = []
    for token, lp in zip(ids, lps, strict=False):
        logprob, top = _parts(lp)
        out.append(entry(token, logprob) | {"top_logprobs": [entry(t, v) for t, v in top]})
    return out


class CompletionLogprobs:
    """The legacy completions' `logprobs` object, in pieces as a stream sends them:
    `text_offset` counts characters from the start of the choice's text (its echoed prompt
    included)."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self.texts = texts
        self.offset = offset

    def take(self, ids: Sequence[int], lps: Sequence[Any], *, prompt: bool = False) -> dict[str, Any]:
        """These tokens' entries; `prompt` ones (`echo`) from offset 0, a token with no
        log-probability (the prompt's first) None in both lists, as vLLM gives it; the output's
        then start at the echoed text's end."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        end = self.offset
        if prompt:
            self.offset = 0
        for token, lp in zip(ids, lps, strict=False):
            text = self.texts(token)
            out["tokens"].append(text)
            if prompt and lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                logprob, top = _parts(lp)
                out["token_logprobs"].append(logprob)
                tops: dict[str, float] = {}
                for t, v in top:  # tokens that read alike share a key: the likelier one's
                    tops.setdefault(self.texts(t), v)
                out["top_logprobs"].append(tops)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        if prompt:
            self.offset = end
        return out


def sglang(
    texts: TokenTexts, ids: Sequence[int], lps: Sequence[Any], with_text: bool, *, prompt: bool = False
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's `meta_info.output_token_logprobs` and `output_top_logprobs`: [logprob, token id,
    text or None] per token, and per token a list of those for the most likely tokens. `prompt`
    tokens (`input_token_logprobs`, `input_top_logprobs`): one with no log-probability (the
    first, where the scoring starts) is `[None, id, text]` with None for its top tokens."""
    chosen: list[list[Any]] = []
    tops: list[list[list[Any]] | None] = []
    for token, lp in zip(ids, lps, strict=prompt):
        text = texts(token) if with_text else None
        if prompt and lp is None:
            chosen.append([None, token, text])
            tops.append(None)
            continue
        logprob, top = _parts(lp)
        chosen.append([logprob, token, text])
        tops.append([[v, t, texts(t) if with_text else None] for t, v in top])
    return chosen, tops
