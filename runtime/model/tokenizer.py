"""A checkpoint's tokenizer and chat template, on `tokenizers` alone (no transformers at run time).

A GGUF file carries no `tokenizer.json`: its vocabulary, merges, token types and special token
ids sit in metadata under llama.cpp's names, and `from_gguf_metadata` rebuilds the byte-level BPE
tokenizer they describe, the way transformers does for the same file (the tests check that both
encode alike). A Hugging Face directory has its `tokenizer.json` and `tokenizer_config.json`.
Either way `save_pretrained` writes a directory that `transformers.AutoTokenizer` (and so clients
such as AIPerf) loads and that encodes identically.

Special tokens a caller types are text. `encode_chat` keeps the special tokens the chat template
writes (`<|im_start|>`, `<|im_end|>`, ...) and tokenizes those inside messages' contents as the
text they spell (Hugging Face's `split_special_tokens` behaviour, for the contents alone), so a
user cannot open a system turn by typing its marker; `special_tokens_in_content=True` lets them
through as before. A chat with no special token in any content encodes exactly as the whole
rendered text always did.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from hicache.runtime.model.chat_template import render_chat

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# How text is cut before BPE, by llama.cpp's `tokenizer.ggml.pre` name: the regex the vocabulary's
# merges were learned on. Names not listed split like GPT-2 (ByteLevel's own regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# SmolLM's own tokenizer (and llama.cpp's "smollm") cuts digits one by one before GPT-2's regex.
_DIGIT_FIRST = frozenset({"smollm"})
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_MARK = "\U000f0000"  # a private-use character: marks where a message's content is rendered
_PLACE = re.compile(_MARK + r"(\d+)" + _MARK)


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (what byte-level BPE vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


class TextStream:
    """Incremental detokenization for streaming: `step(token)` returns the text it completes
    ('' while a multi-byte character is still unfinished)."""

    def __init__(self, backend: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token: int) -> str:
        return self._stream.step(self._backend, int(token)) or ""


class ChatTokenizer:
    """Text <-> token ids, plus the chat template and the special tokens a server needs."""

    def __init__(
        self,
        backend: Tokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        eos_token_ids: Iterable[int] = (),
        source: str = "",
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens: dict[str, str | None] = {name: None for name in SPECIAL_NAMES}
        self.special_tokens.update(special_tokens or {})
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.eos_token_ids: frozenset[int] = frozenset(int(t) for t in eos_token_ids)
        self.source = source

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters one token spells: `chars / this` is a floor on the tokens of a
        text, which a server checks before tokenizing it. A vocabulary entry's UTF-8 length
        bounds what it spells (a byte-level entry spells one byte, so at most one character, per
        character of it). None when a normalizer could shrink text first (no such floor)."""
        if self.backend.normalizer is not None:
            return None
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS where the checkpoint asks for them."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream(self, *, skip_special_tokens: bool = True) -> TextStream:
        return TextStream(self.backend, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text the chat template makes of `messages` (as `apply_chat_template(...,
        tokenize=False)` would)."""
        if not self.chat_template:
            raise ValueError(f"{self.source or 'tokenizer'}: has no chat template")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **extra,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own special tokens, so none are
        added (as `apply_chat_template` does). A special token inside a message's content is
        tokenized as text unless `special_tokens_in_content` (module notes)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        if special_tokens_in_content or self._special_pattern is None:
            return self.encode(text, add_special_tokens=False)
        spans = self._content_spans(messages, text, add_generation_prompt, extra)
        if not any(self._special_pattern.search(text, a, b) for a, b in spans):
            return self.encode(text, add_special_tokens=False)  # nothing typed: as it always was
        ids: list[int] = []
        start = 0
        for m in self._special_pattern.finditer(text):
            if any(a <= m.start() < b for a, b in spans):
                continue  # typed by the caller: text
            ids += self._as_text.encode(text[start : m.start()], add_special_tokens=False).ids
            ids.append(self._special_ids[m.group()])
            start = m.end()
        ids += self._as_text.encode(text[start:], add_special_tokens=False).ids
        return ids

    @cached_property
    def _special_ids(self) -> dict[str, int]:
        """The special added tokens (what `split_special_tokens` turns into text) and their ids."""
        found = self.backend.get_added_tokens_decoder().items()
        return {tok.content: i for i, tok in found if tok.special and tok.content}

    @cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        tokens = sorted(self._special_ids, key=len, reverse=True)  # the longest of overlapping ones
        return re.compile("|".join(map(re.escape, tokens))) if tokens else None

    @cached_property
    def _as_text(self) -> Tokenizer:
        """A copy of the backend that reads special tokens' spellings as text."""
        copy = Tokenizer.from_str(self.backend.to_str())
        copy.encode_special_tokens = True
        return copy

    def _content_spans(
        self,
        messages: Sequence[Mapping[str, Any]],
        text: str,
        add_generation_prompt: bool,
        extra: Mapping[str, Any],
    ) -> list[tuple[int, int]]:
        """Where each message's content lies in `text`, found by rendering the chat again with a
        marker in place of each content. A template that changes contents as it renders them
        (trims them, say) gets its contents looked for in order instead."""
        contents: list[str] = []
        marked = [dict(m) for m in messages]
        for m in marked:
            if isinstance(m.get("content"), str):
                mark = f"{_MARK}{len(contents)}{_MARK}"
                contents.append(m["content"])
                m["content"] = mark
        rendered = self.render_chat(marked, add_generation_prompt=add_generation_prompt, **extra)
        spans: list[tuple[int, int]] = []
        out: list[str] = []
        at = last = 0
        for place in _PLACE.finditer(rendered):
            out.append(rendered[last : place.start()])
            at += place.start() - last
            n = int(place.group(1))
            content = contents[n] if n < len(contents) else place.group()
            spans.append((at, at + len(content)))
            out.append(content)
            at += len(content)
            last = place.end()
        out.append(rendered[last:])
        if "".join(out) == text:
            return spans
        spans, at = [], 0
        for content in contents:
            found = text.find(content.strip(), at) if content.strip() else -1
            if found >= 0:
                spans.append((found, found + len(content.strip())))
                at = found + len(content.strip())
        return spans

    # -- Hugging Face directories -----------------------------------------------------------------

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` into `out_dir`
        (created if missing), loadable by `transformers.AutoTokenizer.from_pretrained(out_dir)`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        added = {
            str(index): {
                "content": token.content,
                "lstrip": token.lstrip,
                "normalized": token.normalized,
                "rstrip": token.rstrip,
                "single_word": token.single_word,
                "special": token.special,
            }
            for index, token in sorted(self.backend.get_added_tokens_decoder().items())
        }
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "added_tokens_decoder": added,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,
            **{name: token for name, token in self.special_tokens.items() if token is not None},
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
            (out / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return out

    @classmethod
    def from_dir(cls, directory: str | Path, *, eos_token_ids: Iterable[int] = ()) -> ChatTokenizer:
        """The tokenizer of a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`,
        and `chat_template.jinja` when present, which wins over the config's template)."""
        root = Path(directory)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{root}: expected a tokenizer.json (a Hugging Face tokenizer directory)")
        backend = Tokenizer.from_file(str(path))
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_path = root / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")

        def content(value: object) -> str | None:
            return value.get("content") if isinstance(value, dict) else value  # type: ignore[return-value]

        special = {name: content(config.get(name)) for name in SPECIAL_NAMES}
        eos = set(eos_token_ids)
        if special["eos_token"] is not None and backend.token_to_id(special["eos_token"]) is not None:
            eos.add(backend.token_to_id(special["eos_token"]))
        return cls(
            backend,
            chat_template=template,
            special_tokens=special,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            eos_token_ids=eos,
            source=str(root),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, source: str) -> ChatTokenizer:
        """The tokenizer a GGUF file's `tokenizer.*` metadata describes (byte-level BPE only)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{source}: tokenizer.ggml.model is {kind!r}; expected 'gpt2' (byte-level BPE, as in "
                "Llama 3, Qwen2 and SmolLM): sentencepiece vocabularies are not supported from GGUF, "
                "use the checkpoint's Hugging Face directory instead"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise ValueError(f"{source}: tokenizer.ggml.merges is missing; byte-level BPE needs its merges")
        spelling = byte_alphabet()
        alphabet = set(spelling.values())
        # Every real token is written in the byte alphabet; respell any that is not (as transformers does).
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        bpe = models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ", 1)) for m in merges],
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
        backend = Tokenizer(bpe)
        pre = meta.get("tokenizer.ggml.pre")
        byte_level = pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=pre not in PRE_TOKENIZER_SPLITS
        )
        if pre in PRE_TOKENIZER_SPLITS:
            split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
            backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        elif pre in _DIGIT_FIRST:
            digits = pre_tokenizers.Digits(individual_digits=True)
            backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        # Control tokens stay whole and are special; a "control" token outside the byte alphabet
        # is a llama.cpp mislabel, skipped as transformers does. User-defined ones stay whole too.
        types = types + [1] * (len(tokens) - len(types))
        backend.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _CONTROL and set(t) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _USER_DEFINED
            ]
        )

        def token_of(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

        special = {
            "bos_token": token_of("bos_token_id"),
            "eos_token": token_of("eos_token_id"),
            "unk_token": token_of("unknown_token_id"),
            "pad_token": token_of("padding_token_id"),
        }
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _template_processor(backend, special, add_bos, add_eos)
        eos_ids = {
            int(meta[f"tokenizer.ggml.{key}"])
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if meta.get(f"tokenizer.ggml.{key}") is not None
        }
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens=special,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            eos_token_ids=eos_ids,
            source=source,
        )


def _template_processor(
    backend: Tokenizer, special: Mapping[str, str | None], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """BOS/EOS around each sequence exactly when the checkpoint says so."""
    before = [special["bos_token"]] if add_bos and special["bos_token"] else []
    after = [special["eos_token"]] if add_eos and special["eos_token"] else []
    single = [*(f"{t}:0" for t in before), "$A:0", *(f"{t}:0" for t in after)]
    pair = [*single, *(f"{t}:1" for t in before), "$B:1", *(f"{t}:1" for t in after)]
    used = {t: backend.token_to_id(t) for t in before + after}
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=[(t, i) for t, i in used.items()]
    )
