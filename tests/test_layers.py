"""The house rules of the layers, read from the source text (nothing is imported).

Bottom to top, each layer imports only itself and the layers below it:

(a) hicache/core/: pure; the standard library's pure parts, attrs, numpy and numba, and nothing
    else of hicache (no shared module, driver or CLI);
(b) the shared pure modules: every hicache/*.py but cli.py and __main__.py, and scenarios/;
    they import the core and each other, never a driver, the CLI, trio or torch;
(c) the drivers sim/ and runtime/: never each other, never the CLI; sim/ never trio or torch;
(d) hicache/cli.py, hicache/__main__.py and the package cli.py owns, hicache/commands/: the only
    modules that may import the drivers (and so wire sim and runtime together); nothing imports them.

Inside runtime/, packages by job, bottom to top (RUNTIME_PACKAGES): each imports itself and the
packages its row names, never one above it, so there is no circle; the modules at runtime/'s top
level wire the packages together, may import any of them, and no package imports them. Nor do
runtime's modules import one another in a circle (a part of the decode node never imports the
service that composes it).

Everywhere: no relative imports, and no bare sim/runtime/scenarios (they install as hicache.*).
Every .py file under hicache/, sim/, runtime/ and scenarios/ must fall in one of these layers.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CORE_IMPURE = {
    "time", "threading", "socket", "asyncio", "subprocess", "multiprocessing", "select", "selectors",
    "signal", "shutil", "tempfile", "os", "io", "pathlib", "random", "datetime", "concurrent",
}  # fmt: skip
CORE_THIRD_PARTY = {"attrs", "numpy", "numba"}
RUNTIME_LIBS = {"trio", "torch"}
DRIVERS = {"hicache.sim", "hicache.runtime"}
TOP = {"hicache.cli", "hicache.__main__", "hicache.commands"}
TOP_FILES = {"hicache/cli.py", "hicache/__main__.py"}  # layer (d): may import anything
TOP_PACKAGES = ("hicache/commands",)  # layer (d) too: the CLI's own modules, owned by cli.py
BARE = {"sim", "runtime", "scenarios"}  # the folders install as hicache.sim etc.
LAYERED_FOLDERS = ("hicache", "sim", "runtime", "scenarios")


def _ban(names: set[str], why: str) -> dict[str, str]:
    return dict.fromkeys(names, why)


@dataclass(frozen=True)
class Rule:
    """What one layer's files must not import; each reason goes into the breach line."""

    layer: str
    banned: Mapping[str, str]
    hicache_within: str | None = None  # set: the only part of hicache this layer may import
    third_party: frozenset[str] | None = None  # set: the only non-stdlib packages it may import
    why_third_party: str = ""


_NO_BARE = _ban(BARE, "the folders install as hicache.sim, hicache.runtime, hicache.scenarios")
_NO_CLI = _ban(TOP, "nothing imports the CLI")
CORE = Rule(
    "hicache/core/",
    _ban(CORE_IMPURE, "the core is pure: no I/O, clock, threads, processes or randomness")
    | _ban(RUNTIME_LIBS, "the core is pure")
    | _NO_BARE,
    hicache_within="hicache.core",
    third_party=frozenset(CORE_THIRD_PARTY),
    why_third_party="the core uses only the standard library's pure parts, attrs, numpy and numba",
)
SHARED = Rule(
    "a shared module",
    _ban(DRIVERS, "only hicache/cli.py, hicache/__main__.py and hicache/commands/ may import the drivers")
    | _NO_CLI
    | _ban(RUNTIME_LIBS, "the shared modules stay free of the runtime's libraries")
    | _NO_BARE,
)
SIM = Rule(
    "sim/",
    _ban({"hicache.runtime"}, "the drivers never import each other")
    | _NO_CLI
    | _ban(RUNTIME_LIBS, "the simulator needs neither trio nor torch")
    | _NO_BARE,
)
RUNTIME = Rule(
    "runtime/",
    _ban({"hicache.sim"}, "the drivers never import each other") | _NO_CLI | _NO_BARE,
)
# runtime/'s packages, bottom to top -> the other runtime packages each may import (what the code
# imports today). The modules at runtime/'s top level (nodes, serve, runner, ...) may import any
# package; no package may import them.
RUNTIME_PACKAGES: dict[str, frozenset[str]] = {
    "kv": frozenset(),
    "model": frozenset(),
    "wire": frozenset({"kv", "model"}),
    "security": frozenset({"wire"}),
    "storage": frozenset({"kv", "security"}),
    "transfer": frozenset({"security"}),
    "tp": frozenset({"kv", "wire", "transfer"}),
    "prefill": frozenset({"kv", "model", "wire", "security", "storage", "transfer", "tp"}),
    "decode": frozenset({"kv", "model", "wire", "security", "storage", "transfer", "tp"}),
    "serving": frozenset({"wire", "security"}),
}
# Modules split by job -> their parts, in the same folder. The module gathers the parts (it
# imports each; llama and twin re-export the parts' public names, so their importers name them
# alone); a part never imports the module that gathers it, and docs/architecture.md names every
# part.
SPLIT_MODULES: dict[str, tuple[str, ...]] = {
    "runtime/model/llama.py": (
        "llama_config", "llama_weights", "attention", "kv_places", "kv_pages", "paged_inputs",
    ),
    "runtime/transfer/tcp.py": ("tcp_wire", "tcp_handshake", "tcp_target"),
    "runtime/storage/file_store.py": ("page_file", "file_io", "file_recovery"),
    "sim/twin.py": (
        "twin_recording", "twin_scenario", "twin_replay", "twin_compare", "twin_intervals", "twin_report",
    ),
    "sim/sweep.py": ("sweep_plan", "sweep_executors", "sweep_table"),
    "scenarios/scenario.py": ("scenario_checks", "scenario_specs", "scenario_schema"),
}  # fmt: skip
# Glob (relative to the repository root) -> the rule for the files it finds; TOP_FILES are exempt.
RULES: dict[str, Rule] = {
    "hicache/core/**/*.py": CORE,
    "hicache/*.py": SHARED,
    "scenarios/**/*.py": SHARED,
    "sim/**/*.py": SIM,
    "runtime/**/*.py": RUNTIME,
}


def imported(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports, anywhere in it; `from hicache import x` counts as hicache.x,
    since x may be a whole layer (hicache.sim, hicache.faults), and `from hicache.runtime import x`
    as hicache.runtime.x, since x may be one of runtime's packages or top-level modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.ImportFrom) and node.module in ("hicache", "hicache.runtime"):
            names += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append((node.lineno, node.module))
    return names


def _match(name: str, rules: Mapping[str, str]) -> str | None:
    """The banned name that `name` is or lies under, if any."""
    return next((r for r in rules if name == r or name.startswith(r + ".")), None)


def _breach(rule: Rule, name: str) -> str | None:
    """Why importing `name` breaks `rule`, or None when it may."""
    if name.startswith("."):
        return f"relative import {name} (use the absolute hicache name)"
    hit = _match(name, rule.banned)
    if hit is not None:
        return f"{rule.layer} must not import {name} ({rule.banned[hit]})"
    top = name.split(".")[0]
    inside = rule.hicache_within
    if inside is not None and top == "hicache" and not (name == inside or name.startswith(inside + ".")):
        return f"{rule.layer} must not import {name} (the core is the bottom layer: nothing else of hicache)"
    allowed = rule.third_party
    if allowed is not None and top != "hicache" and top not in sys.stdlib_module_names | allowed:
        return f"{rule.layer} may not depend on {name} ({rule.why_third_party})"
    return None


def _runtime_package(rel: str) -> str | None:
    """The runtime package a file lies in (runtime/<package>/...), or None."""
    parts = rel.split("/")
    return parts[1] if parts[0] == "runtime" and len(parts) > 2 else None


def _package_breach(package: str, name: str) -> str | None:
    """Why a file of runtime's `package` may not import `name`, or None when it may."""
    parts = name.split(".")
    if parts[:2] != ["hicache", "runtime"] or len(parts) < 3 or parts[2] == package:
        return None
    where = f"runtime/{package}/"
    if parts[2] not in RUNTIME_PACKAGES:
        why = "runtime's top-level modules wire the packages; no package imports them"
        return f"{where} must not import {name} ({why})"
    allowed = RUNTIME_PACKAGES[package]
    if parts[2] not in allowed:
        may = ", ".join(sorted(allowed)) or "none"
        return f"{where} must not import {name} (of runtime's packages it may import only: {may})"
    return None


def runtime_package_imports(root: Path) -> dict[tuple[str, str], str]:
    """(package, package it imports) -> where it first does (file:line), over runtime's packages."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(root.glob("runtime/*/**/*.py")):
        rel = path.relative_to(root).as_posix()
        package = _runtime_package(rel)
        for line, name in imported(path):
            parts = name.split(".")
            other = parts[2] if parts[:2] == ["hicache", "runtime"] and len(parts) > 2 else None
            if package and other and other != package and (root / "runtime" / other).is_dir():
                edges.setdefault((package, other), f"{rel}:{line}")
    return edges


def runtime_module_imports(root: Path) -> dict[tuple[str, str], str]:
    """(module, module it imports) -> where it first does (file:line), over runtime's modules
    (files); `from hicache.runtime.decode import feed` counts as importing runtime/decode/feed.py."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(root.glob("runtime/**/*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[:2] != ["hicache", "runtime"]:
                    continue
                for end in range(len(parts), 2, -1):  # the longest prefix that is a file
                    target = root.joinpath("runtime", *parts[2:end]).with_suffix(".py")
                    if target.is_file():
                        other = target.relative_to(root).as_posix()
                        if other != rel:
                            edges.setdefault((rel, other), f"{rel}:{node.lineno}")
                        break
    return edges


def circles(edges: Mapping[tuple[str, str], str], between: str = "runtime's packages") -> list[str]:
    """One line per circle of imports between packages (or modules: `between` says which; per
    group of them that all reach one another), naming a shortest way round and where each of its
    imports is."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reached = {n: reach(n) for n in graph}
    out, done = [], set()
    for start in sorted(graph):
        if start in done or start not in reached[start]:
            continue
        group = {n for n in reached[start] if start in reached[n]}
        done |= group
        back = {start: start}  # breadth first from start back to start, inside the group
        frontier, way = [start], None
        while frontier and way is None:
            following = []
            for n in frontier:
                for nxt in sorted(graph[n] & group):
                    if nxt == start:
                        way = [start, n]
                        break
                    if nxt not in back:
                        back[nxt] = n
                        following.append(nxt)
                if way is not None:
                    break
            frontier = following
        assert way is not None
        while way[-1] != start:
            way.append(back[way[-1]])
        way.reverse()  # start -> ... -> n -> start
        hops = [edges[(a, b)] for a, b in zip(way, way[1:], strict=False)]
        out.append(f"import circle between {between}: {' -> '.join(way)} ({', '.join(hops)})")
    return out


def breaches(root: Path) -> list[str]:
    """One line per import that breaks its layer's rule, and per file that no layer covers."""
    out = []
    top = TOP_FILES | {p.relative_to(root).as_posix() for d in TOP_PACKAGES for p in (root / d).rglob("*.py")}
    covered = set(top)
    for pattern, rule in RULES.items():
        for path in sorted(root.glob(pattern)):
            rel = path.relative_to(root).as_posix()
            if rel in top:
                continue
            covered.add(rel)
            package = _runtime_package(rel)
            if package is not None and package not in RUNTIME_PACKAGES:
                out.append(f"{rel}: no rule for runtime's package {package} (add it to RUNTIME_PACKAGES)")
                package = None
            for line, name in imported(path):
                why = _breach(rule, name)
                if why is None and package is not None:
                    why = _package_breach(package, name)
                if why is not None:
                    out.append(f"{rel}:{line}: {why}")
    for folder in LAYERED_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel not in covered:
                out.append(f"{rel}: no layer rule covers this file (add it to RULES)")
    return out


def test_layers_are_clean() -> None:
    assert breaches(ROOT) == []


def test_runtime_packages_have_no_import_circle() -> None:
    """Neither the rule table nor what runtime's packages really import goes round in a circle."""
    table = {(a, b): "RUNTIME_PACKAGES" for a, allowed in RUNTIME_PACKAGES.items() for b in allowed}
    assert circles(table) == []
    assert circles(runtime_package_imports(ROOT)) == []


def test_runtime_modules_have_no_import_circle() -> None:
    """Nor do runtime's modules, within a package or across: a part of the decode node never
    imports the service that composes it (`runtime/decode/decode_node.py`)."""
    assert circles(runtime_module_imports(ROOT), "runtime's modules") == []


def test_a_module_import_circle_is_found(tmp_path: Path) -> None:
    for where, line in (
        ("runtime/decode/a.py", "from hicache.runtime.decode.b import X"),
        ("runtime/decode/b.py", "from hicache.runtime.decode import a"),
    ):
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text(line + "\n")
    found = circles(runtime_module_imports(tmp_path), "runtime's modules")
    assert found == [
        "import circle between runtime's modules: runtime/decode/a.py -> runtime/decode/b.py -> "
        "runtime/decode/a.py (runtime/decode/a.py:1, runtime/decode/b.py:1)"
    ], found


def test_every_runtime_package_has_a_rule() -> None:
    """The table names exactly runtime's packages: a new one needs a row, a removed one loses it."""
    found = {p.parent.name for p in ROOT.glob("runtime/*/__init__.py")}
    assert found == set(RUNTIME_PACKAGES)


def test_an_import_circle_is_found(tmp_path: Path) -> None:
    """Two packages that import each other, planted alone, give exactly one line naming both imports."""
    for where, line in (
        ("runtime/kv/a.py", "import hicache.runtime.wire.b"),
        ("runtime/wire/b.py", "from hicache.runtime import kv"),
    ):
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text(line + "\n")
    found = circles(runtime_package_imports(tmp_path))
    assert found == [
        "import circle between runtime's packages: kv -> wire -> kv (runtime/kv/a.py:1, runtime/wire/b.py:1)"
    ], found


def test_every_shared_module_is_found() -> None:
    """The shared layer is found by glob; check it finds today's modules, so a typo in RULES
    cannot leave them unchecked."""
    shared = {p.relative_to(ROOT).as_posix() for p in ROOT.glob("hicache/*.py")} - TOP_FILES
    assert {"hicache/results.py", "hicache/faults.py"} <= shared
    assert {p.name for p in ROOT.glob("scenarios/**/*.py")} >= {"scenario.py", "workload.py"}


BREACHES = [
    # (a) the core
    ("hicache/core/bad.py", "import time", "must not import time"),
    ("hicache/core/sub/bad.py", "from os import path", "must not import os"),
    ("hicache/core/bad.py", "import trio", "must not import trio"),
    ("hicache/core/bad.py", "import requests", "may not depend on requests"),
    ("hicache/core/bad.py", "from hicache.sim import engine", "must not import hicache.sim"),
    ("hicache/core/bad.py", "import hicache.runtime.nodes", "must not import hicache.runtime"),
    ("hicache/core/bad.py", "from hicache.results import summarize", "must not import hicache.results"),
    ("hicache/core/bad.py", "from hicache import faults", "must not import hicache.faults"),
    ("hicache/core/bad.py", "from hicache.scenarios.build import x", "must not import hicache.scenarios"),
    ("hicache/core/bad.py", "from hicache.cli import main", "must not import hicache.cli"),
    ("hicache/core/bad.py", "import scenarios", "must not import scenarios"),
    # (b) the shared modules: hicache/*.py and scenarios/
    ("hicache/bad.py", "import hicache.runtime", "only hicache/cli.py"),
    ("hicache/bad.py", "from hicache.sim.runner import table", "only hicache/cli.py"),
    ("hicache/bad.py", "from hicache import sim", "only hicache/cli.py"),
    ("hicache/bad.py", "from hicache.cli import main", "must not import hicache.cli"),
    ("hicache/bad.py", "import torch", "must not import torch"),
    ("hicache/bad.py", "import trio", "must not import trio"),
    ("scenarios/bad.py", "from hicache.sim.engine import Engine", "only hicache/cli.py"),
    ("scenarios/bad.py", "import hicache.runtime.runner", "only hicache/cli.py"),
    ("scenarios/bad.py", "from hicache import cli", "must not import hicache.cli"),
    ("hicache/bad.py", "from hicache.commands import table", "must not import hicache.commands"),
    ("scenarios/bad.py", "import hicache.commands.parser", "must not import hicache.commands"),
    ("scenarios/bad.py", "import torch.nn", "must not import torch.nn"),
    ("scenarios/bad.py", "import sim.engine", "must not import sim.engine"),
    # (c) the drivers
    ("sim/bad.py", "import torch", "must not import torch"),
    ("sim/bad.py", "import trio", "must not import trio"),
    ("sim/bad.py", "from hicache.runtime.nodes import x", "never import each other"),
    ("sim/bad.py", "from hicache.__main__ import main", "must not import hicache.__main__"),
    ("runtime/bad.py", "from hicache.sim.engine import Engine", "never import each other"),
    ("runtime/storage/bad.py", "import hicache.cli", "must not import hicache.cli"),
    (
        "runtime/bad.py",
        "from hicache.commands.runtime_commands import limits",
        "must not import hicache.commands",
    ),
    ("sim/bad.py", "from hicache.commands import sim_commands", "must not import hicache.commands"),
    ("hicache/core/bad.py", "import hicache.commands", "must not import hicache.commands"),
    ("runtime/bad.py", "import runtime.nodes", "must not import runtime.nodes"),
    # (c) inside runtime/: its packages, bottom to top, and the top-level modules above them all
    ("runtime/storage/bad.py", "from hicache.runtime.decode.decode_node import X", "runtime.decode"),
    ("runtime/storage/bad.py", "from hicache.runtime.serving import app", "import hicache.runtime.serving"),
    ("runtime/security/bad.py", "import hicache.runtime.decode.faults", "import hicache.runtime.decode"),
    ("runtime/security/bad.py", "from hicache.runtime.storage.base import X", "may import only: wire"),
    ("runtime/kv/bad.py", "from hicache.runtime.wire import protocol", "may import only: none"),
    ("runtime/model/bad.py", "from hicache.runtime.kv.kv_pool import KVPool", "import hicache.runtime.kv"),
    ("runtime/decode/bad.py", "from hicache.runtime.prefill.prefill_cache import X", "runtime.prefill"),
    ("runtime/prefill/bad.py", "from hicache.runtime.decode import decode_node", "runtime.decode"),
    ("runtime/serving/bad.py", "from hicache.runtime.model.llama import X", "import hicache.runtime.model"),
    ("runtime/tp/bad.py", "from hicache.runtime import nodes", "top-level modules wire the packages"),
    ("runtime/wire/bad.py", "import hicache.runtime.cache_flags", "top-level modules wire the packages"),
    ("runtime/extra/bad.py", "import os", "no rule for runtime's package extra"),
    # everywhere
    ("sim/bad.py", "from .engine import Engine", "relative import"),
    ("hicache/core/bad.py", "from . import pool", "relative import"),
    ("hicache/bad.py", "from .core import tree", "relative import"),
    # a file outside every layer
    ("hicache/extra/bad.py", "import os", "no layer rule covers"),
]


@pytest.mark.parametrize(("where", "line", "needle"), BREACHES)
def test_a_breach_is_found(tmp_path: Path, where: str, line: str, needle: str) -> None:
    """Each kind of breach, planted alone in an otherwise empty tree, gives exactly one line."""
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text(line + "\n")
    found = breaches(tmp_path)
    assert len(found) == 1 and needle in found[0], found


ALLOWED = [
    ("hicache/core/ok.py", "import numpy as np\nimport attrs\nfrom numba import njit\nimport heapq"),
    ("hicache/core/ok.py", "from hicache.core.pool import SlotPool\nimport hicache.core.tree"),
    ("hicache/core/ok.py", "from __future__ import annotations\nfrom hicache.core import commands as cmd"),
    ("hicache/ok.py", "from hicache.core.tree import TREE\nfrom hicache.faults import FaultSpec"),
    ("hicache/ok.py", "from hicache.scenarios.workload import WorkItem\nimport pathlib, json"),
    ("scenarios/ok.py", "from hicache.results import summarize\nfrom hicache.core.pages import page_keys"),
    ("sim/ok.py", "from hicache.scenarios.build import build_workload\nfrom hicache import faults"),
    ("sim/ok.py", "from hicache.results import summarize\nfrom hicache.core.decode_node import X"),
    ("runtime/ok.py", "import trio\nimport torch\nfrom hicache.results import RequestRecord"),
    ("runtime/ok.py", "from hicache.scenarios.workload import WorkItem\nfrom hicache.faults import decide"),
    ("runtime/ok.py", "from hicache.runtime import nodes\nfrom hicache.runtime.decode.decode_node import X"),
    ("runtime/ok.py", "from hicache.runtime.serving.app import create_app\nimport hicache.runtime.prefill"),
    ("runtime/decode/ok.py", "from hicache.runtime.tp.group import G\nfrom hicache.runtime import kv, wire"),
    ("runtime/decode/ok.py", "from hicache.runtime.decode.faults import X\nimport hicache.runtime"),
    ("runtime/wire/ok.py", "from hicache.runtime.model.llama import TinyConfig\nimport hicache.runtime.kv.x"),
    ("runtime/serving/ok.py", "from hicache.runtime.wire.client import C\nimport hicache.runtime.security.x"),
    ("hicache/cli.py", "import hicache.sim\nimport hicache.runtime\nimport trio"),
    ("hicache/__main__.py", "from hicache.cli import main"),
    (
        "hicache/commands/ok.py",
        "import hicache.sim\nimport hicache.runtime\nimport trio\nfrom hicache import cli",
    ),
    ("hicache/commands/sub/ok.py", "from hicache.commands.parser import Arg\nimport torch"),
]


@pytest.mark.parametrize(("where", "text"), ALLOWED)
def test_an_allowed_import_passes(tmp_path: Path, where: str, text: str) -> None:
    """The rules are exact: what a layer may import (the layers below it) is not flagged."""
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text(text + "\n")
    assert breaches(tmp_path) == []


def test_the_picture_names_every_shared_module() -> None:
    """docs/architecture.md draws the layers; a new shared module must appear in the picture."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layers = re.search(r"^## Layers$(.*?)^## ", text, flags=re.M | re.S)
    assert layers is not None, "docs/architecture.md lost its '## Layers' section"
    shared = sorted(p.name for p in ROOT.glob("hicache/*.py") if p.name != "__init__.py")
    missing = [n for n in shared if n not in layers.group(1)]
    assert missing == [], f"the Layers picture does not name {missing}"


def test_the_docs_name_every_runtime_package() -> None:
    """docs/architecture.md's picture and its runtime section name each of runtime's packages."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layers = re.search(r"^## Layers$(.*?)^## ", text, flags=re.M | re.S)
    runtime = re.search(r"^## The runtime \(`runtime/`\)$(.*?)^## ", text, flags=re.M | re.S)
    assert layers is not None and runtime is not None, "docs/architecture.md lost a section"
    missing = [p for p in sorted(RUNTIME_PACKAGES) if f"{p}/" not in layers.group(1)]
    assert missing == [], f"the Layers picture does not name runtime's packages {missing}"
    missing = [p for p in sorted(RUNTIME_PACKAGES) if f"runtime/{p}/" not in runtime.group(1)]
    assert missing == [], f"the runtime section does not name runtime/{missing}"


def _dotted(rel: str) -> str:
    """The installed name of a module file: runtime/model/llama.py -> hicache.runtime.model.llama."""
    return "hicache." + rel.removesuffix(".py").replace("/", ".")


def split_module_breaches(root: Path) -> list[str]:
    """One line per part of a split module that is missing, not gathered by its module, or
    imports the module that gathers it."""
    out = []
    for rel, parts in SPLIT_MODULES.items():
        whole = _dotted(rel)
        gathered = {name for _, name in imported(root / rel)}
        for part in parts:
            path = (root / rel).with_name(f"{part}.py")
            if not path.is_file():
                out.append(f"{rel}: its part {part}.py is missing")
                continue
            dotted = _dotted(path.relative_to(root).as_posix())
            if not any(name == dotted or name.startswith(dotted + ".") for name in gathered):
                out.append(f"{rel}: does not import its part {dotted}")
            where = path.relative_to(root).as_posix()
            for line, name in imported(path):
                if name == whole or name.startswith(whole + "."):
                    out.append(f"{where}:{line}: a part imports {whole}, which gathers it")
    return out


def test_split_modules_gather_their_parts() -> None:
    assert split_module_breaches(ROOT) == []
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [f"{p}.py" for parts in SPLIT_MODULES.values() for p in parts if f"{p}.py" not in text]
    assert missing == [], f"docs/architecture.md does not name {missing}"


def test_a_part_importing_its_whole_is_found(tmp_path: Path) -> None:
    for rel, parts in SPLIT_MODULES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("".join(f"import {_dotted(rel).rsplit('.', 1)[0]}.{p}\n" for p in parts))
        for p in parts:
            (tmp_path / rel).with_name(f"{p}.py").write_text("")
    tcp = tmp_path / "runtime/transfer/tcp_wire.py"
    tcp.write_text("from hicache.runtime.transfer.tcp import TcpEngine\n")
    (tmp_path / "sim/twin.py").write_text("import hicache.sim.twin_recording\n")
    assert split_module_breaches(tmp_path) == [
        "runtime/transfer/tcp_wire.py:1: a part imports hicache.runtime.transfer.tcp, which gathers it",
        "sim/twin.py: does not import its part hicache.sim.twin_scenario",
        "sim/twin.py: does not import its part hicache.sim.twin_replay",
        "sim/twin.py: does not import its part hicache.sim.twin_compare",
        "sim/twin.py: does not import its part hicache.sim.twin_intervals",
        "sim/twin.py: does not import its part hicache.sim.twin_report",
    ]


def test_every_runtime_package_is_installed() -> None:
    """pyproject.toml lists every package of runtime/ (a non-editable install ships only those)."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = {f"hicache.runtime.{p.parent.name}" for p in ROOT.glob("runtime/*/__init__.py")}
    assert {p for p in listed if p.startswith("hicache.runtime.")} == folders


@pytest.mark.process
def test_shared_layer_check_agrees() -> None:
    tool = ROOT.parent / "shared" / "tools" / "check_layers.py"
    if not tool.exists():
        pytest.skip("../shared/tools/check_layers.py is not beside this checkout")
    done = subprocess.run([sys.executable, str(tool), str(ROOT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_bare_driver_modules_are_installed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "hicache" or p.startswith("hicache.") for p in config["packages"])
    assert config["package-dir"] == {
        "hicache": "hicache",
        "hicache.sim": "sim",
        "hicache.runtime": "runtime",
        "hicache.scenarios": "scenarios",
    }
    import hicache.runtime
    import hicache.scenarios
    import hicache.sim

    for module, folder in (
        (hicache.sim, "sim"),
        (hicache.runtime, "runtime"),
        (hicache.scenarios, "scenarios"),
    ):
        assert Path(module.__file__).resolve().parent == ROOT / folder
