"""Chat templates rendered the way Hugging Face renders them, without transformers.

A checkpoint's chat template is a Jinja program written for `tokenizer.apply_chat_template`; the
prompt a served model sees must be byte-for-byte the one it was trained on, so the environment
here copies transformers': a sandbox, `trim_blocks` and `lstrip_blocks`, loop controls, a
`tojson` that does not escape HTML, `raise_exception`, `strftime_now`, and the special tokens
(`bos_token`, `eos_token`, ...) as variables.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template (cached: a server renders the same one for every request)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


@functools.lru_cache(maxsize=16)
def template_features(template: str) -> frozenset[str]:
    """What `template` renders beyond roles and contents: "tools" if it reads the `tools` variable,
    "tool_calls" if it reads a message's `tool_calls` (a template that names neither would drop
    them, so a request holding them is refused instead)."""
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    found = set()
    if "tools" in jinja2.meta.find_undeclared_variables(env.parse(template)):
        found.add("tools")
    if re.search(r"\btool_calls\b", template):
        found.add("tool_calls")
    return frozenset(found)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    tools: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """The prompt text for `messages` (dicts with at least `role` and `content`).

    `add_generation_prompt` appends the header that opens the assistant's turn; `special_tokens`
    are passed as variables (`bos_token`, `eos_token`, ...), as transformers passes them.
    """
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"messages[{i}]: expected a mapping with 'role' and 'content', got {message!r}")
    plain = [dict(m) for m in messages]
    variables = dict(special_tokens or {})
    variables.update(extra)
    return compile_template(template).render(
        messages=plain, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
    )
