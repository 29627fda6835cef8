"""The test tiers' own rules: `--quick`'s reading of a file's module-level marks agrees with the
file's syntax tree (so it skips exactly the files pytest would deselect whole), and no test reaches
into `bench/` (benchmarks are scripts, free to change; what a test shares with one lives in the
package or in a test helper)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from tiers import TIERS, module_tiers

TESTS = Path(__file__).resolve().parent
FILES = sorted(TESTS.glob("*.py"))


def _declared_tiers(tree: ast.Module) -> frozenset[str]:
    """The tier markers of every top-level `pytestmark = ...`, from the whole file's tree."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            for sub in ast.walk(node.value):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr == "mark"
                ):
                    names.add(sub.attr)
    return frozenset(names & TIERS.keys())


@pytest.mark.parametrize("path", [p for p in FILES if p.name.startswith("test_")], ids=lambda p: p.name)
def test_the_quick_pre_check_reads_the_files_module_marks(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    # A file that never says `pytestmark` declares no tier; parsing it whole would only cost time.
    declared = _declared_tiers(ast.parse(text)) if "pytestmark" in text else frozenset()
    assert module_tiers(path) == declared


def test_the_pre_check_reads_a_list_over_several_lines(tmp_path: Path) -> None:
    path = tmp_path / "test_x.py"
    path.write_text(
        'import pytest\n\npytestmark = [\n    pytest.mark.usefixtures("f"),\n    pytest.mark.slow,\n]\n'
    )
    assert module_tiers(path) == {"slow"}
    path.write_text("import pytest\n\n\ndef test_x() -> None:\n    pytestmark = pytest.mark.slow\n")
    assert module_tiers(path) == frozenset()


BENCH = re.compile(r"sys\.path.*bench|^\s*(from|import)\s+(bench\b|twin_check|serve_clients)", re.MULTILINE)


def test_no_test_imports_from_bench() -> None:
    found = [p.name for p in FILES if BENCH.search(p.read_text(encoding="utf-8"))]
    assert found == [], f"{found}: move what they need out of bench/ into the package or a test helper"
