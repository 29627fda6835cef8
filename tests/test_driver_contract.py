"""Drivers execute commands and read nothing else of the core (read from the source text).

Every fact a driver needs travels on a command or an event (`hicache/core/commands.py`,
`hicache/core/events.py`). This test walks the syntax trees of the drivers (`sim/`,
`runtime/`), the shared modules (`hicache/*.py`), the benchmarks (`bench/`) and the test
harnesses (`tests/kvworld.py`, `tests/lockstep.py`) and fails on any read of a core's
`requests`, or of an underscored attribute of a core object (the core, its tree, pools and
requests). Tests of the core itself may look inside it; harnesses and drivers may not.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HARNESSES = ["tests/kvworld.py", "tests/lockstep.py"]
CORE_NAMES = {"core", "cores", "tree", "device_pool", "host_pool"}


def _chain(node: ast.expr) -> list[str]:
    """The names of an attribute chain, outermost last: `self.core.tree` -> [self, core, tree]."""
    out: list[str] = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    elif isinstance(node, ast.Call):
        out += _chain(node.func)[::-1]
    return out[::-1]


def reads_inside(source: str, filename: str) -> list[str]:
    """Lines of `source` that read a core's requests or an underscored attribute of it."""
    out = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, ast.Attribute):
            continue
        chain = _chain(node.value)
        on_core = bool(chain) and (chain[-1] in CORE_NAMES or chain[-1].endswith("core"))
        if not on_core and not (set(chain) & {"core"}):
            continue
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if (node.attr == "requests" and on_core) or private:
            out.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return out


def files() -> list[Path]:
    found = [
        p
        for d in ("sim", "runtime", "bench")
        for p in sorted((ROOT / d).rglob("*.py"))
        if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)  # bench/.venvs/
    ]
    found += [p for p in sorted((ROOT / "hicache").glob("*.py"))]
    found += [ROOT / h for h in HARNESSES]
    return found


def test_no_driver_harness_or_benchmark_reads_the_cores_insides() -> None:
    bad = [
        hit for p in files() for hit in reads_inside(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))
    ]
    assert not bad, "reads of the core's insides (facts must travel on commands and events):\n" + "\n".join(
        bad
    )


def test_the_check_catches_each_kind_of_read() -> None:
    planted = {
        "self.core.requests[rid]": True,
        "driver.core.requests": True,
        "w.core._transfers": True,
        "self.core.tree._op_nodes": True,
        "core.device_pool._owner": True,
        "self._core_events": False,  # the driver's own attribute
        "self.core.stats.finished": False,
        "self.core.audit()": False,
        "self.live[rid].requests": False,
    }
    for expr, caught in planted.items():
        assert bool(reads_inside(f"x = {expr}\n", "planted.py")) is caught, expr
