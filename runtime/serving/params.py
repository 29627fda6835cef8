"""Checking what clients send, field by field, into typed values or a 400 that names the field.

Both APIs parse through here, so a wrong type, a NaN, a bool where a number belongs or a lone
surrogate gets the same answer whichever door it came in by.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from typing import Any

import attrs
import trio
from starlette.requests import ClientDisconnect, Request

from hicache.runtime.serving.errors import ApiError, bad_request, show
from hicache.runtime.wire.sampling_fields import Sampling, SamplingError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_ID_CHARS = 128
DRAIN_BYTES = 1 << 20  # of a body sent without Content-Length, read past the limit and dropped


THREAD_PARSE_BYTES = 1 << 20  # larger bodies are parsed in a worker thread


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_no_constants)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object, refused with a 413 once it passes `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the body is {declared} bytes; the limit is {max_bytes}", code="body_too_large")
    chunks, size = [], 0
    try:
        async with contextlib.aclosing(request.stream()) as stream:
            async for chunk in stream:
                size += len(chunk)
                if size > max_bytes + DRAIN_BYTES:
                    break  # a client that keeps sending this much more gets no reading
                if size <= max_bytes:
                    chunks.append(chunk)
        if size > max_bytes:
            # The rest was read (up to DRAIN_BYTES) and dropped: a client still sending when
            # the server answers would meet a closed connection instead of the 413.
            raise ApiError(413, f"the body is over the limit of {max_bytes} bytes", code="body_too_large")
    except ClientDisconnect:
        raise bad_request("the client went away before sending the whole body") from None
    raw = b"".join(chunks)
    chunks.clear()
    try:
        if len(raw) > THREAD_PARSE_BYTES:  # off the event loop: other requests go on meanwhile
            data = await trio.to_thread.run_sync(_loads, raw, abandon_on_cancel=True)
        else:
            data = _loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the body is not JSON: {exc}"[:200]) from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, not {type(data).__name__}")
    return data


def is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape
        return False
    return True


def text(value: object, param: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{param}' must be a string, not {show(value)}", param)
    if not is_utf8(value):
        raise bad_request(f"'{param}' holds a lone surrogate, which is not text", param)
    if not value and not allow_empty:
        raise bad_request(f"'{param}' must not be empty", param)
    return value


def integer(value: object, param: str, lo: int, hi: int) -> int:
    """An int in [lo, hi]; a float with an integral value (100.0) counts, a bool does not."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{param}' must be an integer, not {show(value)}", param)
    if not lo <= value <= hi:
        raise bad_request(f"'{param}' must be between {lo} and {hi}, not {show(value)}", param)
    return value


def boolean(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"'{param}' must be true or false, not {show(value)}", param)
    return value


def token_ids(value: object, param: str, vocab_size: int, max_len: int) -> list[int]:
    if not isinstance(value, list):
        raise bad_request(f"'{param}' must be a list of token ids, not {show(value)}", param)
    if len(value) > max_len:
        raise bad_request(f"'{param}' holds {len(value)} ids, more than {max_len}", param)
    for tok in value:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise bad_request(f"'{param}' must hold token ids in [0, {vocab_size}), not {show(tok)}", param)
    return list(value)


def stop_strings(value: object, param: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
        raise bad_request(
            f"'{param}' must be a string or a list of at most {MAX_STOP_STRINGS} strings", param
        )
    stops = tuple(text(s, param) for s in items)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"'{param}' strings must be at most {MAX_STOP_CHARS} characters", param)
    return stops


def request_id(value: object, param: str) -> str | None:
    if value is None:
        return None
    rid = text(value, param)
    if len(rid) > MAX_ID_CHARS or not rid.isprintable():
        raise bad_request(f"'{param}' must be printable and at most {MAX_ID_CHARS} characters", param)
    return rid


@attrs.frozen
class Unsupported:
    """A field the front door cannot honour unless it holds its neutral value."""

    key: str
    neutral: tuple[object, ...]


def _is_neutral(value: object, neutral: tuple[object, ...]) -> bool:
    for n in neutral:
        if n is None or isinstance(n, bool):
            if value is n:  # by identity, so that 0 is not False
                return True
        elif isinstance(n, int | float):
            if isinstance(value, int | float) and not isinstance(value, bool) and value == n:
                return True
        elif type(value) is type(n) and value == n:
            return True
    return False


def refuse_unsupported(obj: Mapping[str, Any], fields: tuple[Unsupported, ...], where: str = "") -> None:
    """A 400 for a field that asks for something this node does not do (n=2, logprobs, ...);
    silently ignoring it would hand back an answer to a question the client did not ask."""
    for field in fields:
        value = obj.get(field.key)
        if not _is_neutral(value, field.neutral):
            raise bad_request(
                f"'{where}{field.key}' = {show(value)} is not supported here", where + field.key
            )


# The sampling fields both APIs take under these very names (the rest: `sampling`'s callers).
SHARED_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
)


def with_logprobs(spec: Sampling, logprobs: bool, top: int, names: Mapping[str, str]) -> Sampling:
    """`spec` asking for log-probabilities (`top` alternatives per token); a value outside the
    node's limits is a 400 naming the client's key (`names` maps ours to it)."""
    try:
        return attrs.evolve(spec, logprobs=logprobs, top_logprobs=top)
    except SamplingError as exc:
        param = names.get(exc.field, exc.field)
        raise bad_request(f"'{param}' must be {exc.expected}, not {show(exc.value)}", param) from None


def scoring_prompt_from(spec: Sampling, start: int, prompt_len: int) -> Sampling:
    """`spec` asking for the prompt's log-probabilities from token `start` (below `prompt_len`):
    their first entry is always None, so only a start below the prompt's last token asks the node
    for any (`prompt_logprobs_from`; prefill then computes the prompt outside its cache)."""
    return attrs.evolve(spec, prompt_logprobs_from=start if start < prompt_len - 1 else -1)


@attrs.frozen
class Asked:
    """Sampling as a request states it, before the prompt's length settles max_new_tokens."""

    max_new_tokens: int | None
    spec: Sampling
    stop: tuple[str, ...]


def sampling(
    obj: Mapping[str, Any],
    *,
    max_keys: tuple[str, ...],
    seed_keys: tuple[str, ...],
    vocab_size: int,
    max_context: int,
    where: str = "",
) -> Asked:
    """The fields both APIs share; `max_keys` and `seed_keys` in order of precedence (the first
    present wins). The sampling fields are checked by `Sampling` itself, with the limits the
    decode node checks them by: what passes here, the node takes."""
    max_new = None
    for key in max_keys:
        if obj.get(key) is not None:
            max_new = integer(obj.get(key), where + key, 1, max_context)
            break
    keys = {name: name for name in SHARED_KEYS}
    keys["seed"] = next((k for k in seed_keys if obj.get(k) is not None), seed_keys[0])
    fields = {name: obj.get(key) for name, key in keys.items()}
    if fields["temperature"] is None:
        fields["temperature"] = 1.0  # both APIs' default; `Sampling`'s own is greedy
    try:
        spec = Sampling.parse(fields, vocab_size)
    except SamplingError as exc:
        param = where + keys.get(exc.field, exc.field)
        raise bad_request(f"'{param}' must be {exc.expected}, not {show(exc.value)}", param) from None
    return Asked(max_new, spec, stop_strings(obj.get("stop"), where + "stop"))


def settle_max_new_tokens(
    prompt_tokens: int, asked: int | None, default: int | None, max_context: int, param: str
) -> int:
    """How many tokens to generate: what was asked if it fits the context, else a 400; when
    nothing was asked, `default` (None: all the room left) cut to the room left."""
    if prompt_tokens == 0:
        raise bad_request("the prompt is empty", param)
    room = max_context - prompt_tokens
    if room < 1:
        raise bad_request(
            f"the prompt is {prompt_tokens} tokens; this node holds at most {max_context} tokens "
            f"(prompt and output), so it has no room to generate",
            param,
        )
    if asked is None:
        return room if default is None else min(default, room)
    if asked > room:
        raise bad_request(
            f"the prompt is {prompt_tokens} tokens and {asked} new tokens were asked for; "
            f"this node holds at most {max_context} tokens (prompt and output)",
            param,
        )
    return asked
