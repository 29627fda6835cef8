"""A command whose optional extra is missing says which extra, in one line, and exits 2; the
table of which extra brings which module matches the extras `pyproject.toml` declares."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hicache.extras import EXTRA_OF_MODULE, missing_extra

ROOT = Path(__file__).resolve().parent.parent
# Distribution name (as pyproject spells it) -> its import name, where they differ.
IMPORT_NAME = {"prometheus-client": "prometheus_client", "mypy": "mypy"}


def _declared() -> dict[str, set[str]]:
    """Extra -> the import names of the distributions it lists."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out: dict[str, set[str]] = {}
    for extra, requirements in extras.items():
        names = {re.split(r"[\[<>=~!; ]", r, maxsplit=1)[0] for r in requirements}
        out[extra] = {IMPORT_NAME.get(n, n.replace("-", "_")) for n in names}
    return out


def test_every_module_in_the_table_is_installed_by_its_extra() -> None:
    declared = _declared()
    for module, extra in EXTRA_OF_MODULE.items():
        provided = declared[extra] | ({"mypyc"} if "mypy" in declared[extra] else set())
        assert module in provided, f"{module} is not installed by the {extra!r} extra"


def test_every_runtime_requirement_is_in_the_table() -> None:
    for module in _declared()["runtime"]:
        assert EXTRA_OF_MODULE.get(module) == "runtime", module


def test_a_module_no_extra_provides_is_not_explained_away() -> None:
    assert missing_extra(ModuleNotFoundError("no", name="hicache.nonexistent")) is None
    assert missing_extra(ModuleNotFoundError("no", name=None)) is None


@pytest.mark.parametrize(
    ("module", "argv"), [("trio", ["serve"]), ("torch", ["serve"]), ("trio", ["node", "prefill"])]
)
def test_a_missing_runtime_extra_is_one_line_and_exit_2(module: str, argv: list[str]) -> None:
    code = (
        "import sys\n"
        f"sys.modules[{module!r}] = None  # as if the extra were not installed\n"
        "from hicache.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert f"needs the 'runtime' extra, which installs {module}" in lines[0]
    assert "pip install 'hicache[runtime]'" in lines[0]
    assert lines[0].startswith("hicache ")
