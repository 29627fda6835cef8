"""The house rules of the layers, read from the source text (nothing is imported).

hicache/core/ imports only the standard library's pure parts, attrs, numpy and numba;
sim/ never imports the runtime, trio or torch; runtime/ never imports sim/; only
hicache/cli.py (and __main__) may import the drivers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CORE_BANNED = {
    "trio", "torch", "time", "threading", "socket", "asyncio", "subprocess", "multiprocessing",
    "select", "selectors", "signal", "shutil", "tempfile", "os", "io", "pathlib", "random",
    "datetime", "concurrent", "hicache.sim", "hicache.runtime", "hicache.scenarios", "hicache.cli",
    "sim", "runtime", "scenarios",
}  # fmt: skip
CORE_THIRD_PARTY = {"attrs", "numpy", "numba"}
RULES = {
    "hicache/core": CORE_BANNED,
    "sim": {"trio", "torch", "hicache.runtime", "runtime", "hicache.cli"},
    "runtime": {"hicache.sim", "sim", "hicache.cli"},
    "scenarios": {"hicache.sim", "hicache.runtime", "sim", "runtime", "hicache.cli", "trio", "torch"},
}


def imported(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.append((node.lineno, "." * node.level + (node.module or "")))
    return names


def _matches(name: str, rules: set[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in rules)


def breaches(root: Path) -> list[str]:
    out = []
    for folder, rules in RULES.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            for line, name in imported(path):
                if name.startswith("."):
                    out.append(f"{rel}:{line}: relative import {name} (use the absolute hicache name)")
                elif _matches(name, rules):
                    out.append(f"{rel}:{line}: {folder}/ must not import {name}")
                elif folder == "hicache/core":
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in CORE_THIRD_PARTY | {"hicache"}:
                        out.append(f"{rel}:{line}: hicache/core/ may not depend on {name}")
    for path in sorted(root.glob("hicache/*.py")):
        if path.name in ("cli.py", "__main__.py"):
            continue
        for line, name in imported(path):
            if _matches(name, {"hicache.sim", "hicache.runtime"}):
                out.append(f"{path.relative_to(root)}:{line}: only hicache/cli.py may import the drivers")
    return out


def test_layers_are_clean() -> None:
    assert breaches(ROOT) == []


@pytest.mark.parametrize(
    ("folder", "line", "needle"),
    [
        ("hicache/core", "import time", "must not import time"),
        ("hicache/core", "from hicache.sim import engine", "must not import hicache.sim"),
        ("hicache/core", "import requests", "may not depend on requests"),
        ("sim", "import torch", "must not import torch"),
        ("runtime", "from hicache.sim.engine import Engine", "must not import hicache.sim"),
        ("hicache", "import hicache.runtime", "only hicache/cli.py"),
    ],
)
def test_a_breach_is_found(tmp_path: Path, folder: str, line: str, needle: str) -> None:
    for f in RULES:
        (tmp_path / f).mkdir(parents=True, exist_ok=True)
    (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / folder / "bad.py").write_text(line + "\n")
    found = breaches(tmp_path)
    assert len(found) == 1 and needle in found[0], found


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
