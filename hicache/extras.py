"""Which optional extra installs each module a command may need, so that a missing one is one
line naming the `pip install` that brings it, not a traceback.

A core install (`pip install hicache`) runs the simulator, the studies and the demo; the runtime,
`hicache serve` among it, needs the `runtime` extra. The table is checked against the extras in
`pyproject.toml` by the tests, so it cannot drift from what an extra really installs.
"""

from __future__ import annotations

import importlib.util

# Import name -> the extra that installs it.
EXTRA_OF_MODULE: dict[str, str] = {
    "trio": "runtime",
    "torch": "runtime",
    "starlette": "runtime",
    "hypercorn": "runtime",
    "prometheus_client": "runtime",
    "gguf": "runtime",
    "tokenizers": "runtime",
    "safetensors": "runtime",
    "jinja2": "runtime",
    "cryptography": "runtime",
    "nixl": "nixl",
    "ray": "ray",
    "mypy": "compile",
    "mypyc": "compile",
}

# torch's CPU build: a plain `pip install torch` on Linux resolves the CUDA build (several GB).
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """One sentence naming the extra that installs the module `exc` could not import, or None
    when the module is not one an extra provides (then it is a bug, and its traceback is wanted)."""
    name = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(name)
    if extra is None:
        return None
    advice = f"pip install 'hicache[{extra}]'"
    if extra == "runtime":
        advice = f"{CPU_TORCH} (for a CPU-only machine), then {advice}"
    return f"needs the {extra!r} extra, which installs {name}: {advice}"


def require(*modules: str) -> None:
    """Raise `ModuleNotFoundError` for the first of `modules` that is not installed, without
    importing any: a command that starts processes which need them (serve's nodes) says which
    extra is missing before it starts anything, and its own process stays free of them."""
    for name in modules:
        if importlib.util.find_spec(name) is None:  # None too where sys.modules holds None
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
