"""Will a scenario fit this machine? An estimate made before anything is allocated.

A value such as `system_prompt = 1e12` or `conversations = 1e12` is valid on its face but would
end in a MemoryError (or the OS killing the process) after minutes of work. The estimates here
are lower bounds of what the workload's token arrays need, so a refusal is certain to be right;
the field named is the one set out of the ordinary (`blame`).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

TOKEN_BYTES = 4  # int32 token ids
REQUEST_BYTES = 300  # a request's objects besides its tokens (measured: ~1 KB; a lower bound)


def memory_budget() -> int:
    """Bytes this process may use: the machine's RAM, or less under an address-space limit."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not a POSIX system that says
        ram = 1 << 62
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return min(ram, soft) if soft != resource.RLIM_INFINITY else ram


def size(nbytes: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} bytes"


def blame(budget: float, estimate: Callable[[T], float], variants: Mapping[str, tuple[T, T]]) -> str:
    """The field to blame for an estimate beyond `budget`: `variants` maps each field to the
    input with that field at its default and at its smallest value. A field whose default
    alone makes it fit is the one set out of the ordinary (the lowest such); when there is none
    (a machine too small for ordinary values, or two fields out of bounds), the field whose
    smallest value lowers the estimate most. The first of equals wins (dicts keep their order)."""
    ordinary = {field: estimate(v[0]) for field, v in variants.items()}
    fits = {field: need for field, need in ordinary.items() if need <= budget}
    if fits:
        return min(fits, key=fits.__getitem__)
    smallest = {field: estimate(v[1]) for field, v in variants.items()}
    return min(smallest, key=smallest.__getitem__)


def _multiturn(p: Mapping[str, Any]) -> float:
    """Turn k's prompt: system + k + 1 user turns + k outputs; then its own output."""
    n, t = p["conversations"], p["turns"]
    user, out = p["user_tokens"][0], p["output_tokens"][0]
    per = t * p["system_prompt"] + user * t * (t + 1) // 2 + out * (t * (t - 1) // 2 + t)
    return n * (per * TOKEN_BYTES + t * REQUEST_BYTES)


def _agentic(p: Mapping[str, Any]) -> float:
    """Step k's prompt: system + task + k (output + tool result); then its own output."""
    n, t = p["sessions"], p["steps"]
    out, tool = p["output_tokens"][0], p["tool_output_tokens"][0]
    per = t * (p["system_prompt"] + p["task_tokens"][0] + out) + (out + tool) * t * (t - 1) // 2
    return n * (per * TOKEN_BYTES + t * REQUEST_BYTES)


def _shared_prefix(p: Mapping[str, Any]) -> float:
    g, k = p["groups"], p["prompts_per_group"]
    per = p["system_prompt"] + p["question_tokens"][0] + p["output_tokens"][0]
    return g * p["system_prompt"] * TOKEN_BYTES + g * k * (per * TOKEN_BYTES + REQUEST_BYTES)


ESTIMATES: dict[str, tuple[Callable[[Mapping[str, Any]], float], dict[str, Any]]] = {
    "multiturn": (
        _multiturn,
        {"conversations": 1, "turns": 1, "system_prompt": 0, "user_tokens": (1, 1), "output_tokens": (1, 1)},
    ),
    "agentic": (
        _agentic,
        {
            "sessions": 1,
            "steps": 1,
            "system_prompt": 0,
            "task_tokens": (1, 1),
            "tool_output_tokens": (1, 1),
            "output_tokens": (1, 1),
        },
    ),
    "shared_prefix": (
        _shared_prefix,
        {
            "groups": 1,
            "prompts_per_group": 1,
            "system_prompt": 0,
            "question_tokens": (1, 1),
            "output_tokens": (1, 1),
        },
    ),
}


def generated_bytes(kind: str, params: Mapping[str, Any]) -> float:
    """A lower bound of the memory a generated workload's requests take."""
    return ESTIMATES[kind][0](params)


def misfit(
    kind: str, params: Mapping[str, Any], defaults: Mapping[str, Any], budget: int
) -> tuple[str, str] | None:
    """(field, why) when the generated workload cannot fit in `budget` bytes, else None;
    `defaults` are the generator's own."""
    if kind not in ESTIMATES:
        return None
    estimate, smallest = ESTIMATES[kind]
    need = estimate(params)
    if need <= budget:
        return None
    variants = {f: ({**params, f: defaults[f]}, {**params, f: low}) for f, low in smallest.items()}
    field = blame(budget, estimate, variants)
    why = (
        f"the generated requests need at least {size(need)} of memory ({params[field]!r} here), "
        f"more than the {size(budget)} this machine has"
    )
    return field, why
