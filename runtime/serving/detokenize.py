"""Turning output tokens into text as they come, without ever taking back what was sent.

A token can end halfway through a UTF-8 character, and a tokenizer may decode a token
differently at the start of a sequence than after its neighbours (SentencePiece's leading
space). So, like Hugging Face's text-generation-inference, decode a short window twice — the
tokens already shown as context, and the same plus the new ones — and emit only the
difference, and only once it no longer ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Feed it ids with `push`; it returns the text that became final. `flush` at the end
    returns whatever is left, incomplete characters included (as U+FFFD)."""

    def __init__(self, codec: Decoder) -> None:
        self._codec = codec
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window: ids already shown, decoded for context
        self._read = 0  # end of what has been shown

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        shown = self._codec.decode(self._ids[self._prefix : self._read])
        whole = self._codec.decode(self._ids[self._prefix :])
        if len(whole) > len(shown) and (final or not whole.endswith(REPLACEMENT)):
            self._prefix, self._read = self._read, len(self._ids)
            return whole[len(shown) :]
        return ""
